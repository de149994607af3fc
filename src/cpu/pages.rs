//! Weights on 2 MiB pages. Decode streams every weight once per token; on 4 KiB pages that is
//! a TLB miss every 4 KiB, and in a virtual machine each miss walks two page tables. Measured on
//! the 2-core CI machine (a VM): a bf16 matrix × vector ran at 19.9 GB/s on 4 KiB pages and at
//! 28.6 GB/s on transparent huge pages, the triad bandwidth. Linux backs an anonymous range with
//! huge pages when asked with `madvise(MADV_HUGEPAGE)` before it is first touched (THP's
//! "madvise" mode, the usual default). The allocator may hand out memory that was touched
//! before (glibc serves blocks under its adaptive mmap threshold, up to 32 MiB, from reused
//! heap), so once written the range is also collapsed onto huge pages (`MADV_COLLAPSE`, Linux
//! 6.1+). Where neither works the memory stays ordinary and only the speed differs.

use std::cell::Cell;
use std::mem::MaybeUninit;

use rayon::prelude::*;

use candle_core::{DType, Device, Result, Tensor};

use super::arena::Huge;

/// Tensors smaller than this stay where they are (a huge page is 2 MiB).
const MIN_BYTES: usize = 4 << 20;

/// A huge page (the unit of `HUGEPAGE` and `COLLAPSE` advice).
const HUGE: usize = 2 << 20;
/// A base page (the unit of `release`).
const PAGE: usize = 4096;

/// `madvise(advice)` over the whole `page`-sized pages inside `[ptr, ptr + len)` (neighbours
/// sharing a partial page keep it).
fn advise(ptr: *const u8, len: usize, page: usize, advice: i32) {
    #[cfg(target_os = "linux")]
    {
        let start = (ptr as usize).div_ceil(page) * page;
        let end = (ptr as usize + len) / page * page;
        if end > start {
            // SAFETY: the range lies inside an allocation or read-only file mapping this process
            // owns; the advices used here only change how its pages are backed (or drop file
            // pages it never wrote, which fault back in unchanged), never their contents.
            // Failure leaves it as it was.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len, page, advice);
}

#[cfg(target_os = "linux")]
const HUGEPAGE: i32 = libc::MADV_HUGEPAGE;
/// Linux's MADV_COLLAPSE (not in every libc's headers).
#[cfg(target_os = "linux")]
const COLLAPSE: i32 = 25;
#[cfg(not(target_os = "linux"))]
const HUGEPAGE: i32 = 0;
#[cfg(not(target_os = "linux"))]
const COLLAPSE: i32 = 0;

/// Fills a fresh vector of `len` elements with `fill` on huge pages.
fn on_huge_pages<T>(len: usize, fill: impl FnOnce(&mut Vec<T>)) -> Vec<T> {
    let mut v = Vec::with_capacity(len);
    let bytes = len * std::mem::size_of::<T>();
    advise_huge(v.as_ptr() as *const u8, bytes);
    fill(&mut v);
    collapse(v.as_ptr() as *const u8, bytes);
    v
}

/// Asks for huge pages over the whole ones inside `[ptr, ptr + len)`, before first touch.
pub(super) fn advise_huge(ptr: *const u8, len: usize) {
    advise(ptr, len, HUGE, HUGEPAGE);
}

/// Moves the whole huge pages inside `[ptr, ptr + len)` onto huge pages now (contents kept).
pub(super) fn collapse(ptr: *const u8, len: usize) {
    advise(ptr, len, HUGE, COLLAPSE);
}

/// Drops the contents of the whole huge pages inside `[ptr, ptr + len)`, which must be
/// anonymous memory no one reads before writing it again: they leave the resident set and
/// fault back in zeroed.
pub(super) fn discard(ptr: *const u8, len: usize) {
    #[cfg(target_os = "linux")]
    advise(ptr, len, HUGE, libc::MADV_DONTNEED);
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// A fresh vector of `len` elements on huge pages, written in parallel: `init(i, part)` must
/// write every element of part `i` (parts of `part` elements, the last one shorter). The parts
/// run on the rayon pool, so the first touch of the new pages (the kernel zeroing them: most of
/// a large repack's time, measured with perf on the Q8_0 start) is spread over every thread
/// instead of falling on the caller's. Bands of `band` parts go in turn; `band_done(parts
/// written so far)` runs on the caller's thread after each.
pub fn huge_parts<T: Copy + Send + Sync>(len: usize, part: usize, band: usize, init: impl Fn(usize, &mut [MaybeUninit<T>]) + Sync, band_done: impl FnMut(usize)) -> Vec<T> {
    on_huge_pages(len, |v| {
        in_bands(&mut v.spare_capacity_mut()[..len], part, band, init, band_done);
        // SAFETY: `in_bands` had `init` write every element of `0..len`.
        unsafe { v.set_len(len) };
    })
}

/// As `huge_parts`, in the weights' home (`arena`: on huge pages from end to end, small
/// weights sharing them).
pub fn weight_parts<T: Copy + Send + Sync>(len: usize, part: usize, band: usize, init: impl Fn(usize, &mut [MaybeUninit<T>]) + Sync, band_done: impl FnMut(usize)) -> Huge<T> {
    Huge::build(len, |spare| in_bands(spare, part, band, init, band_done))
}

/// `init` over the parts of `spare`, in parallel, band by band (`huge_parts`).
fn in_bands<T: Send>(spare: &mut [MaybeUninit<T>], part: usize, band: usize, init: impl Fn(usize, &mut [MaybeUninit<T>]) + Sync, mut band_done: impl FnMut(usize)) {
    let part = part.max(1);
    let band = band.max(1).saturating_mul(part);
    for (b, chunk) in spare.chunks_mut(band).enumerate() {
        let first = b * band / part;
        chunk.par_chunks_mut(part).enumerate().for_each(|(i, p)| init(first + i, p));
        band_done(first + chunk.len().div_ceil(part));
    }
}

/// Elements a worker writes at a time in the copies below (256 KiB of f32).
const PART: usize = 1 << 16;

/// Writes `src` into `dst` (equal lengths).
fn write_all<T: Copy>(dst: &mut [MaybeUninit<T>], src: &[T]) {
    for (d, s) in dst.iter_mut().zip(src) {
        d.write(*s);
    }
}

/// A copy of `src` on huge pages (in bands, telling `copied` how far it got).
pub fn huge_copy<T: Copy + Send + Sync>(src: &[T]) -> Vec<T> {
    let band = (BAND_BYTES / (PART * std::mem::size_of::<T>().max(1))).max(1);
    huge_parts(src.len(), PART, band, |i, p| write_all(p, &src[i * PART..i * PART + p.len()]), |done| copied(done * PART, src.len()))
}

/// A copy of `src` in the weights' home (in bands, telling `copied` how far it got).
pub fn weight_copy<T: Copy + Send + Sync>(src: &[T]) -> Huge<T> {
    let band = (BAND_BYTES / (PART * std::mem::size_of::<T>().max(1))).max(1);
    weight_parts(src.len(), PART, band, |i, p| write_all(p, &src[i * PART..i * PART + p.len()]), |done| copied(done * PART, src.len()))
}

/// `parts` one after another, in the weights' home (joined weights: no intermediate copy).
pub fn weight_concat<T: Copy + Send + Sync>(parts: &[&[T]]) -> Huge<T> {
    let starts: Vec<usize> = parts.iter().scan(0, |at, p| Some(std::mem::replace(at, *at + p.len()))).collect();
    let len = parts.iter().map(|p| p.len()).sum();
    weight_parts(
        len,
        PART,
        usize::MAX,
        |i, mut dst| {
            // Output part `i` may span the end of one source and the start of the next.
            let mut at = i * PART;
            while !dst.is_empty() {
                let j = starts.partition_point(|&s| s <= at) - 1;
                let src = &parts[j][at - starts[j]..];
                let n = src.len().min(dst.len());
                let (head, rest) = dst.split_at_mut(n);
                write_all(head, &src[..n]);
                (dst, at) = (rest, at + n);
            }
        },
        |_| {},
    )
}

/// How much a packer copies between two `copied` calls.
pub const BAND_BYTES: usize = 32 << 20;

thread_local! {
    /// The mapped bytes a `releasing` copy reads from: (address, length, bytes released).
    static SOURCE: Cell<(usize, usize, usize)> = const { Cell::new((0, 0, 0)) };
}

/// Runs `copy`, which copies `src` (a tensor in a read-only file mapping) into its packed home,
/// letting the copy loops (`huge_copy`, `panels::Panels::new`) release `src`'s pages behind
/// them, and releases the rest after. So even the largest tensor (a 248k-row embedding table)
/// is never resident both in the file and in its copy.
pub fn releasing<R>(src: &[u8], copy: impl FnOnce() -> R) -> R {
    let prev = SOURCE.replace((src.as_ptr() as usize, src.len(), 0));
    let r = copy();
    SOURCE.set(prev);
    release(src);
    r
}

/// Called by copy loops on this thread: the first `done` of `total` equal parts (rows,
/// elements) of the `releasing` source are copied, so its pages up to there may go.
pub fn copied(done: usize, total: usize) {
    let (at, len, gone) = SOURCE.get();
    if len == 0 || total == 0 {
        return;
    }
    let upto = (len as u128 * done.min(total) as u128 / total as u128) as usize;
    if upto > gone {
        // SAFETY: `at..at + len` is the slice `releasing` was given, alive while it runs.
        release(unsafe { std::slice::from_raw_parts((at + gone) as *const u8, upto - gone) });
        SOURCE.set((at, len, upto));
    }
}

/// `madvise(MADV_DONTNEED)` over the whole 4 KiB pages inside `bytes`, which must lie in a
/// read-only file mapping: its pages leave this process's resident set (the page cache keeps
/// them, and a later read faults them back in unchanged).
pub fn release(bytes: &[u8]) {
    #[cfg(target_os = "linux")]
    advise(bytes.as_ptr(), bytes.len(), PAGE, libc::MADV_DONTNEED);
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}

/// As `weight_parts`, each part filled with `fill` by its worker before `init` sees it.
pub fn weight_filled<T: Copy + Send + Sync>(len: usize, part: usize, band: usize, fill: T, init: impl Fn(usize, &mut [T]) + Sync, band_done: impl FnMut(usize)) -> Huge<T> {
    let filled = |i: usize, p: &mut [MaybeUninit<T>]| {
        p.iter_mut().for_each(|x| {
            x.write(fill);
        });
        // SAFETY: every element of the part was just written.
        init(i, unsafe { &mut *(p as *mut [MaybeUninit<T>] as *mut [T]) });
    };
    weight_parts(len, part, band, filled, band_done)
}

/// A large contiguous CPU tensor moved onto huge pages (a copy; the original is dropped by the
/// caller); any other tensor as it is.
pub fn rehome(t: Tensor) -> Result<Tensor> {
    if !matches!(t.device(), Device::Cpu) || !t.is_contiguous() || t.elem_count() * t.dtype().size_in_bytes() < MIN_BYTES {
        return Ok(t);
    }
    let shape = t.shape().clone();
    let copy = {
        let (storage, layout) = t.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else { return Ok(t.clone()) };
        let (o, n) = (layout.start_offset(), t.elem_count());
        match t.dtype() {
            DType::F32 => Tensor::from_vec(huge_copy(&cpu.as_slice::<f32>()?[o..o + n]), shape, &Device::Cpu)?,
            DType::BF16 => Tensor::from_vec(huge_copy(&cpu.as_slice::<half::bf16>()?[o..o + n]), shape, &Device::Cpu)?,
            DType::F16 => Tensor::from_vec(huge_copy(&cpu.as_slice::<half::f16>()?[o..o + n]), shape, &Device::Cpu)?,
            _ => return Ok(t.clone()),
        }
    };
    Ok(copy)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The copy holds the same values, shape and dtype; small tensors are not copied.
    #[test]
    fn rehome_keeps_values() -> Result<()> {
        let t = crate::testing::randn(118, (1200, 1000), 1.)?.to_dtype(DType::BF16)?;
        let r = rehome(t.clone())?;
        assert_eq!(r.dims(), t.dims());
        assert_eq!(r.dtype(), DType::BF16);
        let d = (r.to_dtype(DType::F32)? - t.to_dtype(DType::F32)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(d, 0.0);
        let v = weight_filled(3 << 20, PART, 1, 7u8, |_, _| {}, |_| {});
        assert!(v.len() == 3 << 20 && v.iter().all(|&b| b == 7));
        Ok(())
    }

    /// The parallel builders write every element once, in place: a copy and a join of sources
    /// whose lengths are not multiples of a worker's part (so parts span two sources), and
    /// parts handed out in bands with the count reported after each.
    #[test]
    fn parallel_copies_are_exact() {
        let src: Vec<u32> = (0..(3 * PART + 17) as u32).collect();
        assert_eq!(huge_copy(&src), src);
        let (a, b, c) = (&src[..PART / 3], &src[PART / 3..PART / 3 + 5], &src[PART / 3 + 5..]);
        assert_eq!(*weight_concat(&[a, b, &[], c]), src);
        assert_eq!(*weight_copy(&src), src);
        let mut seen = vec![];
        let v: Vec<u64> = huge_parts(10, 3, 2, |i, p| p.iter_mut().enumerate().for_each(|(j, x)| { x.write((i * 3 + j) as u64); }), |n| seen.push(n));
        assert_eq!(v, (0..10).collect::<Vec<u64>>());
        assert_eq!(seen, [2, 4]);
    }
}
