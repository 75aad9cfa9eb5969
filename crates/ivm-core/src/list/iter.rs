//! Walking a [`List`]: [`Iter`] (by reference, double-ended) and [`CursorMut`] (which can
//! unlink the node it is on), with the `List` methods that make them.
//!
//! Separate from `list.rs` because neither changes a hook's state word except through
//! `List::unlink`: they only follow the pointers of a list they borrow.

use core::fmt;
use core::iter::FusedIterator;
use core::marker::PhantomData;

use super::links::{Link, Links};
use super::{Linked, List};

impl<T: Linked<Tag> + ?Sized, Tag> List<T, Tag> {
    /// An iterator over the nodes, front to back (also double-ended).
    pub fn iter(&self) -> Iter<'_, T, Tag> {
        Iter {
            front: self.head,
            back: self.tail,
            len: self.len,
            _list: PhantomData,
        }
    }

    /// A cursor on the first node (or on the "ghost" past the end, if the list is empty)
    /// that can unlink the node it is on while walking the list.
    pub fn cursor_mut(&mut self) -> CursorMut<'_, T, Tag> {
        CursorMut {
            current: self.head,
            list: self,
        }
    }
}

impl<'a, T: Linked<Tag> + ?Sized, Tag> IntoIterator for &'a List<T, Tag> {
    type Item = &'a T;
    type IntoIter = Iter<'a, T, Tag>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// An iterator over the nodes of a [`List`], by reference. Made by [`List::iter`].
pub struct Iter<'a, T: Linked<Tag> + ?Sized, Tag> {
    front: Link<T>,
    back: Link<T>,
    /// Nodes not yet yielded from either end.
    len: usize,
    _list: PhantomData<&'a List<T, Tag>>,
}

impl<'a, T: Linked<Tag> + ?Sized, Tag> Iterator for Iter<'a, T, Tag> {
    type Item = &'a T;

    fn next(&mut self) -> Option<&'a T> {
        if self.len == 0 {
            return None;
        }
        let node = self.front?;
        self.len -= 1;
        // SAFETY: `node` is linked into the list borrowed for 'a, which keeps it alive and
        // its pointers unchanged; `into_ptr` pointers are valid for reads (Linked).
        unsafe {
            self.front = Links::next(T::links(node));
            Some(node.as_ref())
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.len, Some(self.len))
    }
}

impl<'a, T: Linked<Tag> + ?Sized, Tag> DoubleEndedIterator for Iter<'a, T, Tag> {
    fn next_back(&mut self) -> Option<&'a T> {
        if self.len == 0 {
            return None;
        }
        let node = self.back?;
        self.len -= 1;
        // SAFETY: as in `next`.
        unsafe {
            self.back = Links::prev(T::links(node));
            Some(node.as_ref())
        }
    }
}

impl<T: Linked<Tag> + ?Sized, Tag> ExactSizeIterator for Iter<'_, T, Tag> {}

impl<T: Linked<Tag> + ?Sized, Tag> FusedIterator for Iter<'_, T, Tag> {}

impl<T: Linked<Tag> + ?Sized, Tag> Clone for Iter<'_, T, Tag> {
    fn clone(&self) -> Self {
        Self {
            front: self.front,
            back: self.back,
            len: self.len,
            _list: PhantomData,
        }
    }
}

impl<T: Linked<Tag> + ?Sized, Tag> fmt::Debug for Iter<'_, T, Tag> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Iter")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// A cursor over a [`List`] that can unlink the node it is on. Made by
/// [`List::cursor_mut`].
///
/// The cursor is on a node, or on the "ghost" position past the back (and before the
/// front) of the list.
///
/// ```
/// # use core::ptr::NonNull;
/// # use ivm_core::list::{Linked, Links, List};
/// # struct Task { id: u32, run: Links<Task> }
/// # enum RunQueue {}
/// # // SAFETY: `&'static` handles; `links` projects the only hook.
/// # unsafe impl Linked<RunQueue> for Task {
/// #     type Handle = &'static Task;
/// #     fn into_ptr(task: &'static Task) -> NonNull<Task> { NonNull::from(task) }
/// #     // SAFETY: `ptr` came from `into_ptr`.
/// #     unsafe fn from_ptr(ptr: NonNull<Task>) -> &'static Task { unsafe { ptr.as_ref() } }
/// #     unsafe fn links(ptr: NonNull<Task>) -> NonNull<Links<Task>> {
/// #         // SAFETY: `ptr` points to a live `Task`.
/// #         unsafe { NonNull::new_unchecked(&raw mut (*ptr.as_ptr()).run) }
/// #     }
/// # }
/// static TASKS: [Task; 4] = [
///     Task { id: 1, run: Links::new() },
///     Task { id: 2, run: Links::new() },
///     Task { id: 3, run: Links::new() },
///     Task { id: 4, run: Links::new() },
/// ];
/// let mut list = List::<Task, RunQueue>::new();
/// for task in &TASKS {
///     list.push_back(task);
/// }
/// // Unlink the even tasks while walking the list.
/// let mut cursor = list.cursor_mut();
/// while let Some(task) = cursor.current() {
///     if task.id % 2 == 0 {
///         cursor.remove_current(); // moves to the next node
///     } else {
///         cursor.move_next();
///     }
/// }
/// assert_eq!(list.iter().map(|t| t.id).collect::<Vec<_>>(), [1, 3]);
/// ```
pub struct CursorMut<'a, T: Linked<Tag> + ?Sized, Tag> {
    list: &'a mut List<T, Tag>,
    /// The node the cursor is on; `None` is the ghost position.
    current: Link<T>,
}

impl<T: Linked<Tag> + ?Sized, Tag> CursorMut<'_, T, Tag> {
    /// The node the cursor is on, or `None` on the ghost position.
    pub fn current(&self) -> Option<&T> {
        // SAFETY: the current node is linked into the list, which the cursor borrows
        // exclusively and which keeps the node alive while `self` is borrowed.
        self.current.map(|node| unsafe { node.as_ref() })
    }

    /// Moves to the next node; from the last node to the ghost position, and from the ghost
    /// position to the first node.
    pub fn move_next(&mut self) {
        self.current = match self.current {
            // SAFETY: the current node is linked into the borrowed list.
            Some(node) => unsafe { Links::next(T::links(node)) },
            None => self.list.head,
        };
    }

    /// Moves to the previous node; from the first node to the ghost position, and from the
    /// ghost position to the last node.
    pub fn move_prev(&mut self) {
        self.current = match self.current {
            // SAFETY: the current node is linked into the borrowed list.
            Some(node) => unsafe { Links::prev(T::links(node)) },
            None => self.list.tail,
        };
    }

    /// Unlinks the current node and returns its handle, moving the cursor to the next node
    /// (or to the ghost position). Returns `None` on the ghost position.
    pub fn remove_current(&mut self) -> Option<T::Handle> {
        let node = self.current?;
        // SAFETY: `node` is linked into the borrowed list, as the pointer the list stored.
        unsafe {
            self.current = Links::next(T::links(node));
            Some(self.list.unlink(node))
        }
    }

    /// The list the cursor walks.
    pub fn list(&self) -> &List<T, Tag> {
        self.list
    }
}

impl<T: Linked<Tag> + ?Sized, Tag> fmt::Debug for CursorMut<'_, T, Tag> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CursorMut")
            .field("current", &self.current)
            .field("list", &self.list)
            .finish()
    }
}
