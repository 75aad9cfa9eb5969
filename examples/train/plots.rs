//! The demo's pictures, as SVG (`plotters`' SVG backend): the loss per step of every mode
//! with the logistic-regression baseline, and a timeline of each mode's last steps — one
//! lane per thread, spans coloured by what they are (kernels, the graph's protocol, copies,
//! the caller's submit and its wait in the loss read).

use std::path::Path;

use plotters::prelude::*;

use crate::trace::Cat;

fn err(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

const PALETTE: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
];

/// Writes the loss of each named series per step.
pub fn loss(path: &Path, series: &[(&str, &[f32])]) -> std::io::Result<()> {
    let steps = series
        .iter()
        .map(|(_, l)| l.len())
        .max()
        .unwrap_or(1)
        .max(1);
    let top = series
        .iter()
        .flat_map(|(_, l)| l.iter().copied())
        .filter(|x| x.is_finite())
        .fold(0f32, f32::max)
        .max(1e-3);
    let root = SVGBackend::new(path, (900, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("training loss per step", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(0f32..steps as f32, 0f32..top * 1.05)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .draw()
        .map_err(err)?;
    for (i, (name, l)) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(
                l.iter().enumerate().map(|(s, &y)| (s as f32, y)),
                color.stroke_width(1),
            ))
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// One mode's spans for the timeline: (thread, category, start µs, duration µs).
pub type Spans = Vec<(String, Cat, f64, f64)>;

fn cat_color(c: Cat) -> RGBColor {
    match c {
        Cat::Kernel => PALETTE[0],
        Cat::Protocol => PALETTE[1],
        Cat::Submit => PALETTE[2],
        Cat::Read => PALETTE[3],
        // Data moving, as copies do.
        Cat::Copy | Cat::Collective => PALETTE[4],
    }
}

/// Writes a timeline per mode of the last `steps` of `steps_per_epoch` steps recorded
/// (the spans cover one epoch): one lane per thread.
pub fn timeline(
    path: &Path,
    modes: &[(&str, Spans)],
    steps: usize,
    steps_per_epoch: usize,
) -> std::io::Result<()> {
    let lanes_of = |spans: &Spans| {
        let mut t: Vec<String> = spans.iter().map(|s| s.0.clone()).collect();
        t.sort();
        t.dedup();
        t
    };
    let total_lanes: usize = modes.iter().map(|(_, s)| lanes_of(s).len().max(1)).sum();
    let height = 80 + 90 * modes.len() as u32 + 28 * total_lanes as u32;
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root
        .titled(
            "last steps of each mode — blue kernel, orange graph protocol, green submit, \
             red waiting in the loss read, purple copy",
            ("sans-serif", 15),
        )
        .map_err(err)?;
    let weights: Vec<u32> = modes
        .iter()
        .map(|(_, s)| 90 + 28 * lanes_of(s).len().max(1) as u32)
        .collect();
    let mut areas = Vec::new();
    let mut rest = root;
    for (i, w) in weights.iter().enumerate() {
        if i + 1 == weights.len() {
            areas.push(rest.clone());
            break;
        }
        let (a, b) = rest.split_vertically(*w);
        areas.push(a);
        rest = b;
    }
    for ((name, spans), area) in modes.iter().zip(areas) {
        let lanes = lanes_of(spans);
        let end = spans.iter().map(|s| s.2 + s.3).fold(f64::MIN, f64::max);
        let start = spans.iter().map(|s| s.2).fold(f64::MAX, f64::min);
        let window = if spans.is_empty() {
            1.0
        } else {
            (end - start) * steps.min(steps_per_epoch) as f64 / steps_per_epoch.max(1) as f64
        };
        let from = end - window;
        let n = lanes.len().max(1);
        let lane_names = lanes.clone();
        let mut chart = ChartBuilder::on(&area)
            .caption(format!("{name}: last {steps} steps"), ("sans-serif", 14))
            .margin(8)
            .x_label_area_size(26)
            .y_label_area_size(190)
            .build_cartesian_2d(0f64..window.max(1.0), 0f64..n as f64)
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(n * 2 + 1)
            .y_label_formatter(&|y| {
                let i = y.floor() as usize;
                if (y - y.floor() - 0.5).abs() < 1e-6 {
                    lane_names.get(i).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .x_desc("µs")
            .draw()
            .map_err(err)?;
        let visible = spans.iter().filter(|s| s.2 + s.3 >= from);
        chart
            .draw_series(visible.map(|(thread, cat, ts, dur)| {
                let lane = lanes.iter().position(|t| t == thread).unwrap_or(0) as f64;
                let x0 = (ts - from).max(0.0);
                let x1 = (ts + dur - from).max(x0 + 0.05);
                Rectangle::new(
                    [(x0, lane + 0.15), (x1, lane + 0.85)],
                    cat_color(*cat).filled(),
                )
            }))
            .map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svg(path: &Path) -> String {
        let text = std::fs::read_to_string(path).unwrap();
        let doc = roxmltree::Document::parse(&text).expect("well-formed XML");
        assert_eq!(doc.root_element().tag_name().name(), "svg");
        text
    }

    /// The trimmed contents of every `<text>` element.
    fn labels(text: &str) -> Vec<String> {
        let doc = roxmltree::Document::parse(text).unwrap();
        doc.descendants()
            .filter(|n| n.has_tag_name("text"))
            .map(|n| n.text().unwrap_or("").trim().to_string())
            .collect()
    }

    #[test]
    fn both_pictures_are_well_formed_svg_with_a_series_per_mode_and_a_lane_per_thread() {
        let dir = std::env::temp_dir().join(format!("ivm-plots-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let curve = |k: f32| (0..10).map(|i| k / (1.0 + i as f32)).collect::<Vec<f32>>();
        let (a, b, c) = (curve(1.0), curve(1.0), curve(1.2));
        let series = [
            ("plain", a.as_slice()),
            ("eager", b.as_slice()),
            ("logreg", c.as_slice()),
        ];
        let lp = dir.join("loss.svg");
        loss(&lp, &series).unwrap();
        let text = svg(&lp);
        let doc = roxmltree::Document::parse(&text).unwrap();
        // A series is a polyline through its 10 points (axes and legend marks have 2).
        let lines = doc
            .descendants()
            .filter(|n| n.has_tag_name("polyline"))
            .filter(|n| {
                n.attribute("points")
                    .unwrap_or("")
                    .split_whitespace()
                    .count()
                    >= 10
            })
            .count();
        assert_eq!(lines, 3, "one line per series");
        let l = labels(&text);
        for (name, _) in series {
            assert!(l.iter().any(|t| t == name), "legend names {name}: {l:?}");
        }

        let spans = |threads: &[&str]| -> Spans {
            threads
                .iter()
                .enumerate()
                .map(|(i, t)| (t.to_string(), Cat::Kernel, 10.0 * i as f64, 5.0))
                .collect()
        };
        let modes = [
            ("plain", spans(&["main"])),
            ("eager", spans(&["main", "ivm1-cpu:0-t1"])),
            ("lazy", spans(&["main", "graph-step-t0"])),
        ];
        let tp = dir.join("timeline.svg");
        timeline(&tp, &modes, 2, 4).unwrap();
        let l = labels(&svg(&tp));
        let count = |s: &str| l.iter().filter(|t| *t == s).count();
        for thread in ["ivm1-cpu:0-t1", "graph-step-t0"] {
            assert_eq!(count(thread), 1, "a lane for {thread}: {l:?}");
        }
        assert_eq!(count("main"), 3, "a main lane per mode: {l:?}");
        for m in ["plain", "eager", "lazy"] {
            assert_eq!(count(&format!("{m}: last 2 steps")), 1, "a chart for {m}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
