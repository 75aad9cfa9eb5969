//! ivm-device: device adapters for the ivm VM (filled by the device issue).
