//! Test buffers that meet an unmapped page at one edge.
//!
//! Owns [`Guarded`]: a copy of a slice placed in a fresh mapping between two
//! `PROT_NONE` pages, against one of them ([`Edge`]), so a kernel that reads
//! (or writes) even one byte past the buffer's end, or before its start,
//! faults at once instead of reading a neighbour's bytes. [`Edge::End`] is how
//! the weights of a GGUF file sit when a tensor ends at a page-aligned end of
//! the memory-mapped file (issue #46: the AVX2 Q6_K kernel read 2 bytes past
//! its buffer). The kernel tests that use it live in `guard_page_tests.rs`.
//!
//! Invariants: the buffer's last byte ([`Edge::End`]) or first byte
//! ([`Edge::Start`]) touches a `PROT_NONE` page; the buffer is aligned for `T`;
//! the mapping is released on drop.

use std::marker::PhantomData;

/// Which edge of a [`Guarded`] buffer touches its guard page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Edge {
    /// The byte before the buffer's first is unmapped (catches under-reads).
    Start,
    /// The byte after the buffer's last is unmapped (catches over-reads).
    End,
}

impl Edge {
    pub const BOTH: [Edge; 2] = [Edge::Start, Edge::End];
}

/// A slice of `T` with an unmapped page at one edge.
pub struct Guarded<T: Copy> {
    mapping: *mut libc::c_void,
    mapping_len: usize,
    data: *mut T,
    len: usize,
    _owns: PhantomData<T>,
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096)
}

impl<T: Copy> Guarded<T> {
    /// A copy of `values` whose last byte is followed by an unmapped page.
    pub fn from_slice(values: &[T]) -> Self {
        Self::new(values, Edge::End)
    }

    /// A copy of `values` whose `edge` touches an unmapped page.
    pub fn new(values: &[T], edge: Edge) -> Self {
        let page = page_size();
        let bytes = std::mem::size_of_val(values);
        let data_pages = bytes.div_ceil(page).max(1);
        let mapping_len = (data_pages + 2) * page;
        // SAFETY: a fresh private anonymous mapping: guard page, data pages,
        // guard page; the data placed against one guard, inside the data pages.
        unsafe {
            let mapping = libc::mmap(
                std::ptr::null_mut(),
                mapping_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(mapping, libc::MAP_FAILED, "mmap failed");
            let first = mapping.cast::<u8>().add(page);
            assert_eq!(
                libc::mprotect(
                    first.cast(),
                    data_pages * page,
                    libc::PROT_READ | libc::PROT_WRITE
                ),
                0,
                "mprotect failed"
            );
            let data = match edge {
                Edge::Start => first,
                Edge::End => first.add(data_pages * page - bytes),
            }
            .cast::<T>();
            assert!(data.is_aligned(), "{edge:?} of {bytes} bytes is misaligned");
            std::ptr::copy_nonoverlapping(values.as_ptr(), data, values.len());
            Guarded {
                mapping,
                mapping_len,
                data,
                len: values.len(),
                _owns: PhantomData,
            }
        }
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `data` holds `len` initialized elements inside the mapping.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.data, self.len) }
    }
}

impl<T: Copy> Drop for Guarded<T> {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `new` and is released once.
        unsafe { libc::munmap(self.mapping, self.mapping_len) };
    }
}
