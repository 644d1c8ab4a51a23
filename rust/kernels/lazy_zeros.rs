//! Zero-filling a large buffer without writing its pages.
//!
//! Owns [`zero_lazily`]: the page-aligned interior of the buffer is handed back
//! to the kernel with `madvise(MADV_DONTNEED)`, which for private anonymous
//! memory (what `malloc`, and so XLA:CPU's allocator, returns) means the next
//! read of each page sees a fresh zero page and no memory is held until a
//! page is written; only the partial pages at either end are written. A KV
//! pool of several GiB is then ready at once and costs memory only where
//! blocks are used (issue #41: zero-filling SmolLM2's 4 GiB pool took 2.4-7.8 s
//! of every start).
//!
//! Invariants: afterwards every byte of the buffer reads 0, whatever it held;
//! no byte outside it is touched (the advised range is whole pages inside the
//! buffer); where the kernel refuses the advice (a mapping it does not apply
//! to), the bytes are written instead.

/// The system page size (bytes).
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|s| s.is_power_of_two())
        .unwrap_or(4096)
}

/// Set every byte of `buf` to 0, releasing its whole pages instead of writing
/// them. Returns how many bytes were released rather than written.
///
/// `buf` must be private memory of this process (heap or anonymous mapping),
/// which a `&mut [u8]` from an allocator is; for a shared or file mapping the
/// kernel would refuse or refill from the file, and the bytes are written.
pub fn zero_lazily(buf: &mut [u8]) -> usize {
    let page = page_size();
    let start = buf.as_ptr() as usize;
    let first = start.next_multiple_of(page);
    let last = (start + buf.len()) / page * page;
    if last <= first {
        buf.fill(0);
        return 0;
    }
    let (head, rest) = buf.split_at_mut(first - start);
    let (interior, tail) = rest.split_at_mut(last - first);
    head.fill(0);
    tail.fill(0);
    // SAFETY: the range is whole pages inside `buf`, which we hold exclusively;
    // MADV_DONTNEED only drops their contents (they read back as zeros).
    let advised = unsafe {
        libc::madvise(
            interior.as_mut_ptr().cast(),
            interior.len(),
            libc::MADV_DONTNEED,
        )
    };
    if advised != 0 || !is_private_anonymous_zero(interior, page) {
        interior.fill(0);
        return 0;
    }
    interior.len()
}

/// Whether the first byte of each of a few advised pages reads 0: a cheap
/// check that the advice had the zeroing effect (it has for private
/// anonymous memory); reading a dropped page maps the shared zero page, so
/// this costs no memory.
fn is_private_anonymous_zero(interior: &[u8], page: usize) -> bool {
    let pages = interior.len() / page;
    [0, pages / 2, pages.saturating_sub(1)]
        .iter()
        .all(|&p| interior[p * page] == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resident pages of `buf` (mincore).
    fn resident_pages(buf: &[u8]) -> usize {
        let page = page_size();
        let start = buf.as_ptr() as usize / page * page;
        let end = (buf.as_ptr() as usize + buf.len()).next_multiple_of(page);
        let mut map = vec![0u8; (end - start) / page];
        // SAFETY: the range covers mapped pages of `buf`; `map` has one byte a page.
        let rc = unsafe { libc::mincore(start as *mut _, end - start, map.as_mut_ptr()) };
        assert_eq!(rc, 0);
        map.iter().filter(|&&m| m & 1 == 1).count()
    }

    #[test]
    fn every_byte_reads_zero_and_the_neighbours_are_untouched() {
        for (len, offset) in [(0, 0), (1, 3), (4095, 1), (4096, 0), (3 * 4096 + 17, 5)] {
            for len in [len, len + 4096 * 5] {
                let mut backing = vec![0xAAu8; len + offset + 2];
                let buf = &mut backing[offset + 1..offset + 1 + len];
                zero_lazily(buf);
                assert!(buf.iter().all(|&b| b == 0), "len {len} offset {offset}");
                assert_eq!(backing[offset], 0xAA, "the byte before is kept");
                assert_eq!(backing[offset + 1 + len], 0xAA, "the byte after is kept");
            }
        }
    }

    #[test]
    fn a_large_written_buffer_gives_its_memory_back() {
        let len = 64 << 20; // above malloc's mmap threshold: its own mapping
        let mut buf = vec![0x5Au8; len];
        assert!(resident_pages(&buf) * page_size() >= len - page_size());
        let released = zero_lazily(&mut buf);
        assert!(released >= len - 2 * page_size(), "released {released}");
        let resident = resident_pages(&buf);
        assert!(resident <= 16, "{resident} pages still resident");
        assert!(buf.iter().step_by(4096).all(|&b| b == 0));
        buf[len / 2] = 7;
        assert_eq!(buf[len / 2], 7);
    }
}
