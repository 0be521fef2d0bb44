//! The device runtime and its allocators (src/backend/cuda/device.rs, alloc.rs).
use super::*;

/// The plain-allocation fallback (used where the stream-ordered pool is missing or refuses to
/// allocate) gives the same bits as the default allocator, caches freed blocks and hands them out
/// again zeroed.
#[test]
fn plain_allocator_matches_the_default() {
    let be = gpu_or_skip!("opens device 0 with another allocator");
    let plain = CudaBackend::with_allocator(0, Some("plain")).unwrap();
    println!("default allocator: {}", be.alloc_mode().describe());
    assert_eq!(plain.alloc_mode().short(), "plain");
    assert!(plain.name().contains("plain allocator"), "{}", plain.name());
    let mut rng = Rng::new(11);
    let (m, k, n) = (33, 256, 96);
    let x = randn_bf(&mut rng, m * k, 1.0);
    let w = randn_bf(&mut rng, n * k, 0.05);
    let run = |d: &CudaBackend| {
        let mut y = d.zeros(m * n).unwrap();
        d.matmul(&d.upload(&x).unwrap(), &d.upload(&w).unwrap(), None, m, k, n, &mut y).unwrap();
        d.download(&y).unwrap()
    };
    assert_eq!(run(be), run(&plain), "same kernels on the same inputs: the same bits whichever allocator served the memory");
    // a freed 256 MB block stays cached, and comes back zeroed
    let n_big = 64 << 20;
    {
        let mut big = plain.zeros(n_big).unwrap();
        plain.write(&mut big, &vec![1.5f32; n_big]).unwrap();
    }
    let cached = plain.mem_info().unwrap().cached;
    assert!(cached >= 4 * n_big, "the freed block is cached: {cached} bytes");
    let again = plain.zeros(n_big).unwrap();
    assert!(plain.mem_info().unwrap().cached < cached, "the cached block is reused");
    assert!(plain.download(&again).unwrap().iter().all(|&v| v == 0.0), "a reused block is zeroed by zeros()");
}
