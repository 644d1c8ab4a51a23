//! Memory-safety tests of the expert kernels: unrouted experts' pages made
//! unreadable, and every buffer's end (then start) against an unmapped page.
//! A child of `expert_matmul_tests.rs`, whose helpers it uses.

use super::*;

/// A buffer of `experts` equal-sized experts, each a whole number of pages, in
/// a fresh mapping; [`Self::protect_all_but`] unmaps the unrouted ones' pages.
struct PagedExperts {
    mapping: *mut libc::c_void,
    len: usize,
}

impl PagedExperts {
    fn new(bytes: &[u8]) -> Self {
        // SAFETY: a fresh private anonymous mapping, filled, then handed out as
        // a slice of its length.
        unsafe {
            let mapping = libc::mmap(
                std::ptr::null_mut(),
                bytes.len(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(mapping, libc::MAP_FAILED, "mmap failed");
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), mapping.cast(), bytes.len());
            PagedExperts {
                mapping,
                len: bytes.len(),
            }
        }
    }

    /// Make every expert but `kept` unreadable (`PROT_NONE`).
    fn protect_all_but(&self, experts: usize, kept: &[usize]) {
        let per_expert = self.len / experts;
        for e in (0..experts).filter(|e| !kept.contains(e)) {
            // SAFETY: a page-aligned range inside the mapping.
            let status = unsafe {
                libc::mprotect(
                    self.mapping.cast::<u8>().add(e * per_expert).cast(),
                    per_expert,
                    libc::PROT_NONE,
                )
            };
            assert_eq!(status, 0, "mprotect failed");
        }
    }

    fn as_slice<T>(&self) -> &[T] {
        // SAFETY: the mapping holds `len` initialized bytes, page-aligned.
        unsafe {
            std::slice::from_raw_parts(self.mapping.cast(), self.len / std::mem::size_of::<T>())
        }
    }
}

impl Drop for PagedExperts {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `new` and is released once.
        unsafe { libc::munmap(self.mapping, self.len) };
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn as_bytes<T: Copy>(values: &[T]) -> Vec<u8> {
    let len = std::mem::size_of_val(values);
    // SAFETY: plain old data (f32, Bf16) viewed as its bytes.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), len) }.to_vec()
}

/// Rows 1..=6 routed to experts 1 and 3 of 5 (the rest unreadable): the
/// results equal those with every expert readable, so nothing else was read
/// (a read of another expert's pages faults the test process).
#[test]
fn experts_no_row_is_routed_to_are_never_read() {
    if cfg!(miri) {
        return; // mprotect is not interpreted
    }
    let page = page_size();
    let experts = 5;
    let ids = [1, 3, 3, 1, 3, 3];
    let kept = [1, 3];
    let mut rng = TestRng::new(89);
    for kind in QuantType::ALL {
        let inner = kind.block_elems();
        let row_bytes = kind.row_bytes(inner).unwrap();
        // Each expert a whole number of pages.
        let outs = page / gcd(row_bytes, page);
        let shape = ExpertShape {
            rows: ids.len(),
            inner,
            outs,
            experts,
        };
        let q = Quantized::random(&mut rng, kind, &shape);
        let x = floats(&mut rng, shape.rows * inner);
        let call = Routed {
            shape,
            x: &x,
            expert_ids: &ids,
            live_rows: ids.len(),
        };
        let want = q.run(&call, &ScopedThreads).unwrap();
        let paged = PagedExperts::new(&q.w);
        paged.protect_all_but(experts, &kept);
        let mut y = vec![f32::NAN; shape.rows * outs];
        expert_qmatmul(
            &call,
            kind,
            paged.as_slice(),
            &q.scales,
            &mut y,
            &ScopedThreads,
        )
        .unwrap();
        assert_eq!(y, want, "{kind:?}");
    }
    for bf16 in [false, true] {
        let element = if bf16 { 2 } else { 4 };
        let (inner, outs) = (24, page / gcd(24 * element, page));
        let shape = ExpertShape {
            rows: ids.len(),
            inner,
            outs,
            experts,
        };
        let x = floats(&mut rng, shape.rows * inner);
        let call = Routed {
            shape,
            x: &x,
            expert_ids: &ids,
            live_rows: ids.len(),
        };
        let n = experts * outs * inner;
        let (mut want, mut y) = (vec![0.0; shape.rows * outs], vec![0.0; shape.rows * outs]);
        if bf16 {
            let w = bf16s(&mut rng, n);
            expert_matmul(&call, &w, &mut want, &ScopedThreads).unwrap();
            let paged = PagedExperts::new(&as_bytes(&w));
            paged.protect_all_but(experts, &kept);
            expert_matmul::<Bf16>(&call, paged.as_slice(), &mut y, &ScopedThreads).unwrap();
        } else {
            let w = floats(&mut rng, n);
            expert_matmul(&call, &w, &mut want, &ScopedThreads).unwrap();
            let paged = PagedExperts::new(&as_bytes(&w));
            paged.protect_all_but(experts, &kept);
            expert_matmul::<f32>(&call, paged.as_slice(), &mut y, &ScopedThreads).unwrap();
        }
        assert_eq!(y, want, "bf16 {bf16}");
    }
}

/// Every buffer of a call against an unmapped page, at its end then its start,
/// for every format and float type and each path of the dense kernels (one
/// row on an expert, a row group, the quantized panel from 16 rows); the
/// first and last experts are routed to, so the weights' first and last bytes
/// are read. Results equal those on ordinary buffers.
#[test]
fn expert_products_read_nothing_past_their_buffers() {
    let mut rng = TestRng::new(90);
    let experts = 3;
    for rows in [1, 3, 20] {
        // Row 0 on expert 0, the others on the last: 1, 2 and 19 rows there.
        let mut ids = vec![experts as i32 - 1; rows];
        ids[0] = 0;
        for kind in QuantType::ALL {
            let shape = ExpertShape {
                rows,
                inner: 2 * kind.block_elems(),
                outs: 19,
                experts,
            };
            let q = Quantized::random(&mut rng, kind, &shape);
            let x = floats(&mut rng, rows * shape.inner);
            let call = Routed {
                shape,
                x: &x,
                expert_ids: &ids,
                live_rows: rows,
            };
            let want = q.run(&call, &ScopedThreads).unwrap();
            for edge in Edge::BOTH {
                let (gx, gw, gs, gi) = (
                    Guarded::new(&x, edge),
                    Guarded::new(&q.w, edge),
                    Guarded::new(&q.scales, edge),
                    Guarded::new(&ids, edge),
                );
                let mut gy = Guarded::new(&vec![0.0f32; want.len()], edge);
                let guarded = Routed {
                    x: gx.as_slice(),
                    expert_ids: gi.as_slice(),
                    ..call
                };
                let (w, s) = (gw.as_slice(), gs.as_slice());
                expert_qmatmul(&guarded, kind, w, s, gy.as_mut_slice(), &ScopedThreads).unwrap();
                assert_eq!(gy.as_slice(), &want[..], "{kind:?} rows {rows} {edge:?}");
            }
        }
        let shape = ExpertShape {
            rows,
            inner: 37,
            outs: 19,
            experts,
        };
        let x = floats(&mut rng, rows * shape.inner);
        let call = Routed {
            shape,
            x: &x,
            expert_ids: &ids,
            live_rows: rows,
        };
        let n = experts * shape.outs * shape.inner;
        let (wf, wb) = (floats(&mut rng, n), bf16s(&mut rng, n));
        let (mut want_f, mut want_b) = (vec![0.0; rows * 19], vec![0.0; rows * 19]);
        expert_matmul(&call, &wf, &mut want_f, &ScopedThreads).unwrap();
        expert_matmul(&call, &wb, &mut want_b, &ScopedThreads).unwrap();
        for edge in Edge::BOTH {
            let (gx, gi) = (Guarded::new(&x, edge), Guarded::new(&ids, edge));
            let guarded = Routed {
                x: gx.as_slice(),
                expert_ids: gi.as_slice(),
                ..call
            };
            let (gwf, gwb) = (Guarded::new(&wf, edge), Guarded::new(&wb, edge));
            let mut gy = Guarded::new(&vec![0.0f32; rows * 19], edge);
            expert_matmul(&guarded, gwf.as_slice(), gy.as_mut_slice(), &ScopedThreads).unwrap();
            assert_eq!(gy.as_slice(), &want_f[..], "f32 rows {rows} {edge:?}");
            expert_matmul(&guarded, gwb.as_slice(), gy.as_mut_slice(), &ScopedThreads).unwrap();
            assert_eq!(gy.as_slice(), &want_b[..], "bf16 rows {rows} {edge:?}");
        }
    }
}
