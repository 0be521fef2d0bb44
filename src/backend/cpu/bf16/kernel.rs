//! Which microkernel runs a product: `Kernel` (what the caller asks for), the CPU's features and
//! the environment's overrides (`INFOMEM_AMX=0`, `INFOMEM_BF16_PORTABLE=1`), the choice per product
//! (`Micro`: from the kernel and the reduction only, never the row count), and the AMX tile state a
//! scope holds (`Tiles`).
#[cfg(target_arch = "x86_64")]
use super::amx;

/// Which microkernel computes the products (the results are the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// `vdpbf16ps` when the CPU has it and `INFOMEM_BF16_PORTABLE` is unset (or "0"), else
    /// `Avx2` (or `Portable` without AVX2+FMA).
    Auto,
    /// `vdpbf16ps`; panics without AVX512_BF16.
    Native,
    /// AMX tiles (`tdpbf16ps`) where the reduction allows it (see `amx_fits`), else `vdpbf16ps`;
    /// panics without AMX-BF16 (or without the kernel's permission to use it).
    Amx,
    /// f32 FMAs emulating `vdpbf16ps` (any CPU).
    Portable,
    /// AVX2+FMA: the `vdpbf16ps` steps as plain f32 FMAs on widened bf16, for every strip whose
    /// operands cannot reach the denormal range (`plain_fma_exact`), else the portable steps; panics
    /// without AVX2+FMA.
    Avx2,
}

/// Whether this CPU runs the `vdpbf16ps` kernel.
pub fn native_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::backend::cpu::simd::has_avx512bf16()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether `Kernel::Auto` runs `vdpbf16ps` here (AVX512_BF16, `INFOMEM_BF16_PORTABLE` unset):
/// also what lets the bf16 attention run its products on it where AMX is missing.
pub fn vdp_available() -> bool {
    native_available() && !forced_portable()
}

/// Whether this CPU runs the AVX2 kernel (AVX2 and FMA).
pub fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::backend::cpu::simd::has_avx2_fma()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// What `Kernel::Auto` runs on this machine, in words (for the backend's name).
pub fn auto_kernel() -> &'static str {
    if vdp_available() {
        if amx_available() {
            "AMX tiles (vdpbf16ps where a reduction is not a multiple of 32)"
        } else {
            "vdpbf16ps"
        }
    } else if avx2_available() {
        "AVX2 FMAs on widened bf16: no AVX512_BF16"
    } else {
        "portable kernel: no AVX512_BF16, no AVX2"
    }
}

/// `INFOMEM_BF16_PORTABLE` set to anything but "" or "0" (read once).
pub(super) fn forced_portable() -> bool {
    use std::sync::OnceLock;
    static FORCED: OnceLock<bool> = OnceLock::new();
    *FORCED.get_or_init(|| std::env::var_os("INFOMEM_BF16_PORTABLE").is_some_and(|v| !v.is_empty() && v != "0"))
}

/// The microkernel a product runs on (chosen per call from the kernel and the reduction only, so
/// every row of a product, alone or in any batch, takes the same one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Micro {
    Amx,
    Avx512,
    Avx2,
    Portable,
}

impl Kernel {
    /// The microkernel for a reduction of `pairs` pairs in k blocks of `kc`.
    pub(super) fn micro(self, pairs: usize, kc: usize) -> Micro {
        match self {
            Kernel::Auto if vdp_available() => {
                if amx_available() && amx_fits(pairs, kc) {
                    Micro::Amx
                } else {
                    Micro::Avx512
                }
            }
            Kernel::Auto if avx2_available() => Micro::Avx2,
            Kernel::Auto | Kernel::Portable => Micro::Portable,
            Kernel::Avx2 => {
                assert!(avx2_available(), "gemm_bf16: Kernel::Avx2 needs AVX2 and FMA, which this CPU lacks");
                Micro::Avx2
            }
            Kernel::Native => {
                assert!(native_available(), "gemm_bf16: Kernel::Native needs AVX512_BF16, which this CPU lacks");
                Micro::Avx512
            }
            Kernel::Amx => {
                assert!(amx_available(), "gemm_bf16: Kernel::Amx needs AMX-BF16, which this CPU (or its kernel) does not allow");
                if amx_fits(pairs, kc) {
                    Micro::Amx
                } else {
                    Micro::Avx512
                }
            }
        }
    }
}

/// Whether the AMX kernel takes a reduction: every k block a whole number of 16-pair tile steps
/// (SmolLM2's 576, 1536 and 960, Qwen's 896, 2048, 4096… do; a remainder would need a second
/// tile shape, and the `vdpbf16ps` kernel serves those).
pub(super) fn amx_fits(pairs: usize, kc: usize) -> bool {
    pairs % 16 == 0 && kc % 16 == 0
}

/// Whether this process may run the AMX kernel: the CPU has AMX-TILE and AMX-BF16 (and
/// AVX512_BF16, whose conversion the driver shares), `INFOMEM_AMX` is not "0", and Linux granted
/// the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, once per process, for all threads).
pub fn amx_available() -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if std::env::var_os("INFOMEM_AMX").is_some_and(|v| v == "0") || !native_available() {
            return false;
        }
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            // CPUID.(7,0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE
            let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
            if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // Safety: a plain syscall; it fails (and we fall back) on kernels without AMX support
            unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            false
        }
    })
}

/// The AMX tile state held for a scope: configured by `new` where this process may use AMX
/// (`amx_available`), released on drop (a thread without tile state has smaller context
/// switches and signal frames); nothing elsewhere. Tile products inside the scope need not
/// configure (`bf16::thin::product_bf(…, configured: true)`, the bf16 attention's `Products`).
pub(crate) struct Tiles(bool);

impl Tiles {
    pub(crate) fn new() -> Tiles {
        let held = amx_available();
        #[cfg(target_arch = "x86_64")]
        if held {
            // Safety: AMX is present and granted to this process (`amx_available`).
            unsafe { amx::configure() };
        }
        Tiles(held)
    }

    /// Whether the tiles are held (this process uses AMX).
    pub(crate) fn held(&self) -> bool {
        self.0
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        if self.0 {
            // Safety: releasing the tile state is always allowed.
            unsafe { amx::release() };
        }
    }
}
