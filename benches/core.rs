//! Criterion benches of the core's hot paths: the block pool, page tables,
//! the radix prefix cache, and full scheduler steps (schedule + update).
//! Run: `cargo bench --bench core`. Figures go to benches/RESULTS.md.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use kvpage_core::sched::request::RequestParams;
use kvpage_core::sched::scheduler::{Scheduler, SchedulerConfig};
use kvpage_core::{BlockPool, KvCacheManager, PrefixCache};

fn block_pool(c: &mut Criterion) {
    let mut pool = BlockPool::new(4096, 16).unwrap();
    c.bench_function("alloc_free_pair", |b| {
        b.iter(|| {
            let block = pool.allocate_one().unwrap();
            pool.free(black_box(block)).unwrap();
        })
    });
}

fn page_tables(c: &mut Criterion) {
    let mut kv = KvCacheManager::new(8192, 16, false).unwrap();
    let parent = kv.create_sequence(None);
    let mut copies = Vec::new();
    kv.allocate_slots(parent, 256 * 16 - 3, &mut copies)
        .unwrap();
    c.bench_function("fork_free/256_blocks", |b| {
        b.iter(|| {
            let child = kv.fork(black_box(parent)).unwrap();
            kv.free_sequence(child).unwrap();
        })
    });
    c.bench_function("cow_write/fork_write_free", |b| {
        b.iter(|| {
            let child = kv.fork(parent).unwrap();
            copies.clear();
            kv.allocate_slots(child, 1, &mut copies).unwrap();
            black_box(&copies);
            kv.free_sequence(child).unwrap();
        })
    });
}

fn prefix_cache(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..4096u32).map(|i| i * 7 % 32000).collect();
    let mut kv = KvCacheManager::new(8192, 16, true).unwrap();
    let owner = kv.create_sequence(None);
    let mut copies = Vec::new();
    kv.allocate_slots(owner, 4096, &mut copies).unwrap();
    kv.cache_blocks(owner, &tokens).unwrap();
    c.bench_function("radix_match/4096_tokens", |b| {
        b.iter(|| {
            let seq = kv.create_sequence(None);
            assert_eq!(kv.match_prefix(seq, black_box(&tokens)).unwrap(), 4096);
            kv.free_sequence(seq).unwrap();
        })
    });
    let mut radix = PrefixCache::new(512, 16).unwrap();
    let root = radix.acquire_root(None);
    let mut parent = root;
    for (block, chunk) in tokens.chunks_exact(16).enumerate() {
        radix.insert(parent, chunk, block as u32);
        parent = block as u32;
    }
    let mut found = Vec::with_capacity(256);
    c.bench_function("radix_lookup/4096_tokens", |b| {
        b.iter(|| {
            found.clear();
            assert_eq!(
                radix.longest_prefix(root, black_box(&tokens), &mut found),
                256
            );
        })
    });
    let fresh: Vec<u32> = (0..4096u32).map(|i| i * 13 % 32000 + 1).collect();
    c.bench_function("radix_insert/4096_tokens", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let seq = kv.create_sequence(None);
                kv.allocate_slots(seq, 4096, &mut copies).unwrap();
                let start = Instant::now();
                assert_eq!(kv.cache_blocks(seq, black_box(&fresh)).unwrap(), 256);
                total += start.elapsed();
                kv.free_sequence(seq).unwrap();
                kv.reset_prefix_cache().unwrap();
            }
            total
        })
    });
    let mut kv = KvCacheManager::new(4096, 16, true).unwrap();
    c.bench_function("evict/1000_blocks", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                for chain in 0..10u32 {
                    let seq = kv.create_sequence(None);
                    kv.allocate_slots(seq, 100 * 16, &mut copies).unwrap();
                    let t: Vec<u32> = (0..1600u32).map(|i| i + chain * 100_000).collect();
                    kv.cache_blocks(seq, &t).unwrap();
                    kv.free_sequence(seq).unwrap();
                }
                let start = Instant::now();
                assert_eq!(kv.evict(black_box(1000)).unwrap(), 1000);
                total += start.elapsed();
                kv.reset_prefix_cache().unwrap();
            }
            total
        })
    });
}

/// A scheduler with `running` sequences decoding at ~1k context.
fn decoding_scheduler(running: usize) -> Scheduler {
    let mut sched = Scheduler::new(SchedulerConfig {
        num_blocks: running * 80,
        block_size: 16,
        max_num_seqs: running,
        max_num_batched_tokens: running * 1024,
        max_model_len: 4096,
        ..SchedulerConfig::default()
    })
    .unwrap();
    let params = RequestParams {
        max_tokens: 3000,
        ignore_eos: true,
        ..RequestParams::default()
    };
    for r in 0..running as u32 {
        let prompt: Vec<u32> = (0..1000u32).map(|i| (r * 1000 + i) % 100_000).collect();
        sched.add_request(&prompt, params.clone(), 0, None).unwrap();
    }
    let mut events = Vec::new();
    let rows = sched.schedule().unwrap().num_sampled();
    sched.update(&vec![5; rows], &mut events).unwrap();
    sched
}

fn scheduler_steps(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_step");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(4));
    for running in [256usize, 1024, 4096] {
        let sampled = vec![5i64; running];
        group.bench_function(format!("{running}"), |b| {
            // A fresh scheduler every 256 steps keeps the context near 1k
            // tokens; building it is not timed.
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut events = Vec::new();
                let mut done = 0;
                while done < iters {
                    let mut sched = decoding_scheduler(running);
                    let steps = (iters - done).min(256);
                    let start = Instant::now();
                    for _ in 0..steps {
                        let plan = sched.schedule().unwrap();
                        debug_assert_eq!(plan.num_sampled(), running);
                        events.clear();
                        sched.update(&sampled, &mut events).unwrap();
                    }
                    total += start.elapsed();
                    done += steps;
                }
                total
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("add_request");
    group.throughput(criterion::Throughput::Elements(1000));
    let prompt: Vec<u32> = (0..128).collect();
    let params = RequestParams {
        max_tokens: 128,
        ..RequestParams::default()
    };
    group.bench_function("1000_requests_128_tokens", |b| {
        b.iter_batched(
            || {
                Scheduler::new(SchedulerConfig {
                    num_blocks: 1 << 16,
                    max_num_seqs: 1024,
                    ..Default::default()
                })
                .unwrap()
            },
            |mut sched| {
                for _ in 0..1000 {
                    sched
                        .add_request(black_box(&prompt), params.clone(), 0, None)
                        .unwrap();
                }
                sched
            },
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

criterion_group!(
    benches,
    block_pool,
    page_tables,
    prefix_cache,
    scheduler_steps
);
criterion_main!(benches);
