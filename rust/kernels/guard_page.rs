//! Test buffers whose last element is followed by an unmapped page.
//!
//! Owns [`Guarded`]: a copy of a slice placed at the very end of a fresh
//! mapping whose next page is `PROT_NONE`, so a kernel that reads (or writes)
//! even one byte past the buffer's end faults at once instead of reading a
//! neighbour's bytes. This is how the weights of a GGUF file sit when a tensor
//! ends at a page-aligned end of the memory-mapped file (issue #46: the AVX2
//! Q6_K kernel read 2 bytes past its buffer). The kernel tests that use it
//! live in `guard_page_tests.rs`.
//!
//! Invariants: the buffer's last byte is the last byte before the guard page;
//! the buffer is aligned for `T`; the mapping is released on drop.

use std::marker::PhantomData;

/// A slice of `T` that ends where an unmapped page begins.
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
    /// A guarded copy of `values`.
    pub fn from_slice(values: &[T]) -> Self {
        let page = page_size();
        let bytes = std::mem::size_of_val(values);
        let data_pages = bytes.div_ceil(page).max(1);
        let mapping_len = (data_pages + 1) * page;
        // SAFETY: a fresh private anonymous mapping; the last page is then made
        // inaccessible, and the data placed to end exactly where it begins.
        unsafe {
            let mapping = libc::mmap(
                std::ptr::null_mut(),
                mapping_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(mapping, libc::MAP_FAILED, "mmap failed");
            let guard = mapping.cast::<u8>().add(data_pages * page);
            assert_eq!(
                libc::mprotect(guard.cast(), page, libc::PROT_NONE),
                0,
                "mprotect failed"
            );
            let data = guard.sub(bytes).cast::<T>();
            assert!(data.is_aligned());
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

    /// `len` copies of `value`, guarded.
    pub fn filled(len: usize, value: T) -> Self {
        Self::from_slice(&vec![value; len])
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
        // SAFETY: the mapping was made in `from_slice` and is released once.
        unsafe { libc::munmap(self.mapping, self.mapping_len) };
    }
}
