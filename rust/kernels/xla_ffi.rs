//! XLA FFI handlers exported by the `_core` shared library (C ABI, no Python).
//!
//! Owns the `#[no_mangle]` symbols that JAX registers as CPU custom-call targets
//! (`jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(ctypes.CDLL(_core.__file__).<symbol>))`),
//! and the slice of XLA's FFI C API they need (`xla/ffi/api/c_api.h`, API 0.x):
//! the call frame, buffers, the metadata query, error creation and XLA:CPU's
//! intra-op thread pool. Nothing else of that API is used, so only those structs
//! are declared.
//!
//! Handlers run their parallel work on XLA's own thread pool
//! ([`parallel_for`]), never on threads of their own: the pool is already sized
//! to the machine, and a kernel and XLA's dots never compete for cores.
//!
//! Invariants:
//! - a handler never panics across the FFI boundary (panics become errors);
//! - every buffer is checked for count, dtype and rank before its data is read,
//!   and shapes are checked by the kernel before any element is read;
//! - a call with the metadata extension only fills the metadata.

use std::ffi::{c_char, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::kernels::cpu_matmul::{self, MatmulShape, OutPtr};
use crate::kernels::parallel::Parallel;

/// FFI API version these declarations follow (`XLA_FFI_API_MAJOR/MINOR`).
const API_MAJOR: i32 = 0;
const API_MINOR: i32 = 1;

const EXTENSION_METADATA: i32 = 1;
const STAGE_EXECUTE: i32 = 3;
pub(super) const ARG_BUFFER: i32 = 1;
pub(super) const DTYPE_S8: i32 = 2;
pub(super) const DTYPE_U8: i32 = 6;
pub(super) const DTYPE_S32: i32 = 4;
pub(super) const DTYPE_F32: i32 = 11;
pub(super) const DTYPE_F16: i32 = 10;
pub(super) const DTYPE_BF16: i32 = 16;
const ERROR_INVALID_ARGUMENT: i32 = 3;
const ERROR_INTERNAL: i32 = 13;

#[repr(C)]
struct ExtensionBase {
    struct_size: usize,
    kind: i32,
    next: *mut ExtensionBase,
}

#[repr(C)]
struct ApiVersion {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    major: i32,
    minor: i32,
}

#[repr(C)]
struct Metadata {
    struct_size: usize,
    api_version: ApiVersion,
    traits: u32,
    state_type_id: i64,
}

#[repr(C)]
struct MetadataExtension {
    base: ExtensionBase,
    metadata: *mut Metadata,
}

#[repr(C)]
struct ErrorCreateArgs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    message: *const c_char,
    code: i32,
}

type ErrorCreate = unsafe extern "C" fn(*mut ErrorCreateArgs) -> *mut c_void;

#[repr(C)]
struct ErrorDestroyArgs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    error: *mut c_void,
}

type ErrorDestroy = unsafe extern "C" fn(*mut ErrorDestroyArgs);

type Task = unsafe extern "C" fn(*mut c_void);

#[repr(C)]
struct ThreadPoolScheduleArgs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    ctx: *mut c_void,
    task: Option<Task>,
    data: *mut c_void,
}

type ThreadPoolSchedule = unsafe extern "C" fn(*mut ThreadPoolScheduleArgs) -> *mut c_void;

#[repr(C)]
struct ThreadPoolNumThreadsArgs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    ctx: *mut c_void,
    num_threads: *mut i64,
}

type ThreadPoolNumThreads = unsafe extern "C" fn(*mut ThreadPoolNumThreadsArgs) -> *mut c_void;

/// `XLA_FFI_Api` up to the thread pool (API 0.3); fields past `struct_size` of
/// an older XLA are never read.
#[repr(C)]
struct Api {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    api_version: ApiVersion,
    internal_api: *const c_void,
    error_create: Option<ErrorCreate>,
    error_get_message: *const c_void,
    error_destroy: Option<ErrorDestroy>,
    handler_register: *const c_void,
    stream_get: *const c_void,
    type_register: *const c_void,
    execution_context_get: *const c_void,
    state_set: *const c_void,
    state_get: *const c_void,
    device_memory_allocate: *const c_void,
    device_memory_free: *const c_void,
    thread_pool_schedule: Option<ThreadPoolSchedule>,
    thread_pool_num_threads: Option<ThreadPoolNumThreads>,
}

#[repr(C)]
struct Buffer {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    dtype: i32,
    data: *mut c_void,
    rank: i64,
    dims: *const i64,
}

#[repr(C)]
pub(super) struct List {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    pub(super) size: i64,
    types: *const i32,
    items: *const *mut c_void,
}

#[repr(C)]
pub(super) struct CallFrame {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    api: *const Api,
    ctx: *mut c_void,
    stage: i32,
    pub(super) args: List,
    pub(super) rets: List,
    // attrs and the future follow; never read.
}

/// A checked view of one argument or result buffer.
pub(super) struct View {
    pub(super) dtype: i32,
    pub(super) data: *mut c_void,
    pub(super) dims: Vec<usize>,
}

impl View {
    pub(super) fn len(&self) -> usize {
        self.dims.iter().product()
    }
}

pub(super) unsafe fn buffers(list: &List, what: &str, want: usize) -> Result<Vec<View>, String> {
    if list.size != want as i64 {
        return Err(format!("expected {want} {what}, got {}", list.size));
    }
    (0..want)
        .map(|i| {
            if *list.types.add(i) != ARG_BUFFER {
                return Err(format!("{what} {i} is not a buffer"));
            }
            let buffer = &*(*list.items.add(i) as *const Buffer);
            let dims = (0..buffer.rank.max(0) as usize)
                .map(|d| (*buffer.dims.add(d)).max(0) as usize)
                .collect();
            Ok(View {
                dtype: buffer.dtype,
                data: buffer.data,
                dims,
            })
        })
        .collect()
}

unsafe fn fill_metadata(frame: &CallFrame) -> Result<(), String> {
    let extension = &*(frame.extension_start as *const MetadataExtension);
    if extension.base.struct_size < std::mem::size_of::<MetadataExtension>() {
        return Err("metadata extension older than this handler".into());
    }
    let metadata = &mut *extension.metadata;
    let with_state_id = std::mem::size_of::<Metadata>();
    let without_state_id = std::mem::offset_of!(Metadata, traits) + std::mem::size_of::<u32>();
    if metadata.struct_size < without_state_id {
        return Err("metadata struct older than this handler".into());
    }
    metadata.api_version = ApiVersion {
        struct_size: std::mem::size_of::<ApiVersion>(),
        extension_start: std::ptr::null_mut(),
        major: API_MAJOR,
        minor: API_MINOR,
    };
    metadata.traits = 0;
    if metadata.struct_size >= with_state_id {
        metadata.state_type_id = 0; // stateless
    }
    Ok(())
}

unsafe fn error(frame: &CallFrame, code: i32, message: &str) -> *mut c_void {
    let api = &*frame.api;
    let Some(create) = api.error_create else {
        return std::ptr::null_mut();
    };
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let mut args = ErrorCreateArgs {
        struct_size: std::mem::size_of::<ErrorCreateArgs>(),
        extension_start: std::ptr::null_mut(),
        message: text.as_ptr(),
        code,
    };
    create(&mut args) // XLA copies the message
}

/// Work shared by the caller and the pool tasks of one [`parallel_for`].
///
/// The units are cut into one contiguous segment per thread: the caller starts
/// on the first, each pool task on the next one, and a thread whose segment is
/// used up claims what is left of the others'. Contiguous ranges matter: a
/// product's units are adjacent weight rows, and two threads taking alternate
/// 16-row tiles ran no faster than one (`cargo bench --bench cpu_matmul --
/// split`, 30 one-row Q4_1 products, 2-core VM: one thread 4.09 ms, two on
/// alternate tiles 4.33 ms, two on halves 2.49 ms; benches/RESULTS.md).
///
/// A unit is claimed by exactly one thread (its segment's `next`); the caller
/// returns only after every unit is `finished`. A task that starts late claims
/// nothing and never touches `work`, which lives on the caller's stack.
///
/// A thread adds its count of finished units to `finished` once, when it has
/// nothing left to claim, and `finished` has a cache line of its own: counted
/// per unit, by both threads, on the line holding `work`, that one `lock inc`
/// took 91 % of this function's samples, ~10 % of a one-request MoE decode's
/// (`perf annotate`, 2026-11-28; benches/RESULTS.md).
struct SharedJob {
    segments: Vec<Segment>,
    /// Segments handed out so far (the caller takes the first).
    started: AtomicUsize,
    finished: Finished,
    panicked: AtomicBool,
    work: *const (dyn Fn(usize) + Sync),
}

/// Units finished so far, on a cache line of its own.
#[repr(align(64))]
struct Finished(AtomicUsize);

/// Units `next..end` of one thread's share, on a cache line of its own.
#[repr(align(64))]
struct Segment {
    next: AtomicUsize,
    end: usize,
}

// SAFETY: `work` is only called for claimed units, all of which finish before
// the caller (who owns the closure) returns.
unsafe impl Send for SharedJob {}
unsafe impl Sync for SharedJob {}

impl SharedJob {
    fn new(units: usize, threads: usize, work: *const (dyn Fn(usize) + Sync)) -> Self {
        let threads = threads.clamp(1, units.max(1));
        let segments = (0..threads)
            .map(|t| Segment {
                next: AtomicUsize::new(t * units / threads),
                end: (t + 1) * units / threads,
            })
            .collect();
        Self {
            segments,
            started: AtomicUsize::new(0),
            finished: Finished(AtomicUsize::new(0)),
            panicked: AtomicBool::new(false),
            work,
        }
    }

    /// Run the units of this thread's segment, then what is left of the others'.
    fn claim_until_done(&self) {
        let count = self.segments.len();
        let first = self.started.fetch_add(1, Ordering::Relaxed) % count;
        let mut done = 0;
        for segment in (first..count).chain(0..first).map(|s| &self.segments[s]) {
            loop {
                let unit = segment.next.fetch_add(1, Ordering::Relaxed);
                if unit >= segment.end {
                    break;
                }
                // SAFETY: see the struct docs.
                let work = unsafe { &*self.work };
                if catch_unwind(AssertUnwindSafe(|| work(unit))).is_err() {
                    self.panicked.store(true, Ordering::Relaxed);
                }
                done += 1;
            }
        }
        if done > 0 {
            self.finished.0.fetch_add(done, Ordering::Release);
        }
    }
}

unsafe extern "C" fn run_pool_task(data: *mut c_void) {
    let job = Arc::from_raw(data as *const SharedJob);
    job.claim_until_done();
}

unsafe fn destroy_error(api: &Api, error: *mut c_void) {
    if let Some(destroy) = api.error_destroy {
        let mut args = ErrorDestroyArgs {
            struct_size: std::mem::size_of::<ErrorDestroyArgs>(),
            extension_start: std::ptr::null_mut(),
            error,
        };
        destroy(&mut args);
    }
}

/// Threads of XLA's intra-op pool for this call (1 without a pool).
unsafe fn pool_threads(frame: &CallFrame) -> usize {
    let api = &*frame.api;
    let has_pool = api.struct_size >= std::mem::size_of::<Api>();
    let (Some(_), Some(num_threads)) = (
        has_pool.then_some(api.thread_pool_schedule).flatten(),
        has_pool.then_some(api.thread_pool_num_threads).flatten(),
    ) else {
        return 1;
    };
    let mut threads: i64 = 0;
    let mut args = ThreadPoolNumThreadsArgs {
        struct_size: std::mem::size_of::<ThreadPoolNumThreadsArgs>(),
        extension_start: std::ptr::null_mut(),
        ctx: frame.ctx,
        num_threads: &mut threads,
    };
    let error = num_threads(&mut args);
    if !error.is_null() {
        destroy_error(api, error);
        return 1;
    }
    threads.max(1) as usize
}

/// XLA's intra-op pool as seen from one call frame.
pub(super) struct XlaPool<'f> {
    pub(super) frame: &'f CallFrame,
}

impl Parallel for XlaPool<'_> {
    fn threads(&self) -> usize {
        // SAFETY: the frame is XLA's, valid for the whole call.
        unsafe { pool_threads(self.frame) }
    }

    fn run(&self, units: usize, work: &(dyn Fn(usize) + Sync)) -> Result<(), String> {
        // SAFETY: as above.
        unsafe { parallel_for(self.frame, units, work) }
    }
}

/// Run `work(0..units)` on the calling thread and pool tasks; returns when every
/// unit has run. Never waits for a task that has not started: the caller claims
/// units too, so a busy or absent pool only makes it slower.
unsafe fn parallel_for(
    frame: &CallFrame,
    units: usize,
    work: &(dyn Fn(usize) + Sync),
) -> Result<(), String> {
    let helpers = pool_threads(frame).min(units).saturating_sub(1);
    if helpers == 0 {
        (0..units).for_each(work);
        return Ok(());
    }
    // SAFETY: erase the closure's lifetime; it outlives every use (struct docs).
    let work: *const (dyn Fn(usize) + Sync + '_) = work;
    let work: *const (dyn Fn(usize) + Sync) = std::mem::transmute(work);
    let job = Arc::new(SharedJob::new(units, helpers + 1, work));
    let api = &*frame.api;
    let schedule = api.thread_pool_schedule.expect("checked by pool_threads");
    for _ in 0..helpers {
        let data = Arc::into_raw(Arc::clone(&job)) as *mut c_void;
        let mut args = ThreadPoolScheduleArgs {
            struct_size: std::mem::size_of::<ThreadPoolScheduleArgs>(),
            extension_start: std::ptr::null_mut(),
            ctx: frame.ctx,
            task: Some(run_pool_task),
            data,
        };
        let error = schedule(&mut args);
        if !error.is_null() {
            drop(Arc::from_raw(data as *const SharedJob));
            destroy_error(api, error);
            break;
        }
    }
    job.claim_until_done();
    let mut spins = 0u32;
    while job.finished.0.load(Ordering::Acquire) < units {
        spins += 1;
        if spins < 1 << 12 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
    if job.panicked.load(Ordering::Relaxed) {
        return Err("a parallel unit panicked".into());
    }
    Ok(())
}

/// Run `body` for an execute call frame, turning errors and panics into XLA errors.
pub(super) unsafe fn handle(
    frame: *mut CallFrame,
    name: &str,
    body: unsafe fn(&CallFrame) -> Result<(), String>,
) -> *mut c_void {
    let frame = &*frame;
    let is_metadata_query =
        !frame.extension_start.is_null() && (*frame.extension_start).kind == EXTENSION_METADATA;
    let result = catch_unwind(AssertUnwindSafe(|| {
        if is_metadata_query {
            fill_metadata(frame)
        } else if frame.stage != STAGE_EXECUTE {
            Ok(())
        } else {
            body(frame)
        }
    }));
    match result {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(message)) => error(frame, ERROR_INVALID_ARGUMENT, &format!("{name}: {message}")),
        Err(_) => error(frame, ERROR_INTERNAL, &format!("{name}: panicked")),
    }
}

/// The f32 lanes of the vectorized kernel [`kvpage_matmul_nt`] runs on this CPU
/// (16 AVX-512, 8 AVX2 + FMA), or 0 for the portable loop, for callers deciding
/// which products to route to it.
#[no_mangle]
pub extern "C" fn kvpage_matmul_nt_lanes() -> i32 {
    cpu_matmul::lanes() as i32
}

/// XLA FFI handler: `y = x · wᵀ` for few rows ([`crate::kernels::cpu_matmul`]).
/// Arguments: `x [T, K]` f32, `w [N, K]` f32 (an `[out, in]` weight); result
/// `y [T, N]` f32. Tiles of output columns run on XLA's intra-op pool.
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn kvpage_matmul_nt(frame: *mut c_void) -> *mut c_void {
    handle(frame.cast(), "kvpage_matmul_nt", run_matmul_nt)
}

unsafe fn run_matmul_nt(frame: &CallFrame) -> Result<(), String> {
    let args = buffers(&frame.args, "arguments", 2)?;
    let mut rets = buffers(&frame.rets, "results", 1)?;
    let [x, w] = &args[..] else {
        unreachable!("two arguments checked")
    };
    let y = &mut rets[0];
    for (view, name) in [(x, "x"), (w, "w"), (&*y, "y")] {
        if view.dims.len() != 2 {
            return Err(format!("{name} has rank {}, expected 2", view.dims.len()));
        }
        if view.dtype != DTYPE_F32 {
            return Err(format!("{name} must be float32"));
        }
    }
    let shape = MatmulShape {
        rows: x.dims[0],
        inner: x.dims[1],
        outs: w.dims[0],
    };
    if w.dims[1] != shape.inner || y.dims != [shape.rows, shape.outs] {
        return Err(format!(
            "inconsistent shapes: x {:?}, w {:?}, y {:?}",
            x.dims, w.dims, y.dims
        ));
    }
    let x_s = std::slice::from_raw_parts(x.data as *const f32, x.len());
    let w_s = std::slice::from_raw_parts(w.data as *const f32, w.len());
    let y_s = std::slice::from_raw_parts_mut(y.data as *mut f32, y.len());
    cpu_matmul::validate(&shape, x_s, w_s, y_s)?;
    let out = OutPtr::new(y_s);
    // SAFETY: validated; each tile is claimed by exactly one thread.
    let tile = |index: usize| unsafe { cpu_matmul::matmul_nt_tile(&shape, x_s, w_s, out, index) };
    XlaPool { frame }.run(cpu_matmul::tiles(&shape), &tile)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job_for(units: usize, threads: usize, work: &(dyn Fn(usize) + Sync)) -> SharedJob {
        let work: *const (dyn Fn(usize) + Sync + '_) = work;
        // SAFETY: every test below finishes its claims before `work` goes away.
        let work: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(work) };
        SharedJob::new(units, threads, work)
    }

    #[test]
    fn every_unit_runs_once_whoever_claims_it() {
        for (units, threads, claimers) in [(0, 2, 2), (1, 2, 2), (7, 2, 1), (50, 3, 3), (9, 4, 2)] {
            let counts: Vec<AtomicUsize> = (0..units).map(|_| AtomicUsize::new(0)).collect();
            let work = |unit: usize| {
                counts[unit].fetch_add(1, Ordering::Relaxed);
            };
            let job = job_for(units, threads, &work);
            std::thread::scope(|scope| {
                for _ in 0..claimers {
                    scope.spawn(|| job.claim_until_done());
                }
            });
            assert_eq!(job.finished.0.load(Ordering::Relaxed), units);
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn each_thread_starts_on_a_contiguous_range_of_its_own() {
        let order = std::sync::Mutex::new(Vec::new());
        let work = |unit: usize| order.lock().unwrap().push(unit);
        let job = job_for(10, 2, &work);
        job.claim_until_done(); // the caller's segment first, then the helper's
        assert_eq!(*order.lock().unwrap(), (0..10).collect::<Vec<_>>());
        order.lock().unwrap().clear();
        let job = job_for(10, 2, &work);
        job.started.store(1, Ordering::Relaxed); // as the second thread to arrive
        job.claim_until_done();
        assert_eq!(*order.lock().unwrap(), [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]);
    }
}
