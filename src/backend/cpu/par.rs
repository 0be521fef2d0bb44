//! What the CPU kernels share to split work across rayon's threads: a raw pointer tasks may
//! carry (each writes a disjoint region), the row count of a cheap row-wise task, and the L2
//! prefetch hint.

/// Raw pointer that may cross rayon tasks; every user writes a disjoint region.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    /// Method access (not field access) so closures capture the whole Send wrapper.
    #[inline]
    pub fn get(self) -> *mut T {
        self.0
    }
}

/// Rows per rayon task for cheap row-wise ops (keeps task overhead well below the work; the
/// split does not change any result: rows are independent).
pub(crate) const ROWS_PER_TASK: usize = 64;

/// Ask L2 for the `n` elements at `p` (one prefetch per 64-byte line; a no-op elsewhere).
#[inline(always)]
pub(crate) fn prefetch_l2<T>(p: *const T, n: usize) {
    #[cfg(target_arch = "x86_64")]
    for i in (0..n).step_by(64 / std::mem::size_of::<T>()) {
        // Safety: prefetch never faults; the address is only a hint.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p.wrapping_add(i) as *const i8) };
    }
}
