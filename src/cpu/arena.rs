//! The packed weights' home: slices of 2 MiB-aligned mappings that are advised onto huge pages
//! before anything touches them, so a weight lies on huge pages from its first byte to its
//! last, and small weights share them.
//!
//! A weight in its own heap allocation starts and ends inside some 2 MiB page, and only the
//! whole huge pages strictly inside it can be huge: on the 2-core Zen 4 VM a 0.5B Q4_K_M
//! model had 250 of its 435 MB of anonymous memory on huge pages (none of any q/k/v or o
//! product, a third of each 5.7 MiB gate/up on 4 KiB pages), and a decode step walks the page
//! tables every 4 KiB of those. From here 389 MB are, and decode went from 75-80 % to 81-83 %
//! of the triad measured either side of each step. Weights are carved out of chunks of
//! `CHUNK` bytes (a larger one gets a chunk of its own, rounded up to a huge page), first fit
//! over the chunk's free runs, so a joined q/k/v's freed parts are reused by the next layer's
//! and the freed runs' whole huge pages go back to the system. What stays resident beyond the
//! weights is the partly used huge page at each end of a run left free at the end of loading
//! (3 MiB for the 0.5B model, 9 MiB for the 3B-width one: 1.4 % of its weights). A chunk is
//! unmapped when its last weight is dropped. Weights under `MIN_BYTES` stay on the heap.

use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

/// A huge page.
const HUGE: usize = 2 << 20;
/// Bytes of address space reserved at a time (larger weights get a chunk of their own). Only
/// what weights touch is ever resident, and weights lie back to back, so the huge page a
/// weight ends in is where the next one starts: with 32 MiB chunks a 3B model's weights
/// (25 and 13 MiB each) left a partly used huge page at the end of nearly every chunk, 16 MiB
/// in all.
const CHUNK: usize = 1 << 30;
/// Weights smaller than this are ordinary heap vectors (a tiny test model's weights would
/// each touch a 2 MiB page of a chunk otherwise).
pub const MIN_BYTES: usize = 256 << 10;
/// Every weight starts on a cache line (`panels::Line` is 64-byte aligned).
const ALIGN: usize = 64;

/// `len` values of `T` on huge pages (or, under `MIN_BYTES`, on the heap), read-only once
/// built.
pub struct Huge<T> {
    home: Home<T>,
}

enum Home<T> {
    Heap(Vec<T>),
    Chunk { chunk: Arc<Chunk>, at: usize, bytes: usize, ptr: NonNull<T>, len: usize },
}

// SAFETY: a `Huge` owns its values (its run of the chunk is its alone until dropped), as a
// `Vec<T>` does.
unsafe impl<T: Send> Send for Huge<T> {}
unsafe impl<T: Sync> Sync for Huge<T> {}

impl<T> std::ops::Deref for Huge<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.home {
            Home::Heap(v) => v,
            // SAFETY: `ptr..ptr + len` was fully written in `Huge::build_in` and lives in `chunk`,
            // which this value keeps mapped.
            Home::Chunk { ptr, len, .. } => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), *len) },
        }
    }
}

impl<T> Drop for Huge<T> {
    fn drop(&mut self) {
        if let Home::Chunk { chunk, at, bytes, ptr, len } = &self.home {
            // SAFETY: the values were initialised and are dropped once, here.
            unsafe { std::ptr::drop_in_place(std::ptr::slice_from_raw_parts_mut(ptr.as_ptr(), *len)) };
            chunk.give_back(*at, *bytes);
        }
    }
}

impl<T> std::fmt::Debug for Huge<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let place = if matches!(self.home, Home::Heap(_)) { "heap" } else { "huge pages" };
        write!(f, "{} values on {place}", self.len())
    }
}

impl<T: Send> Huge<T> {
    /// `len` values written by `fill` (every one of them) into uninitialised memory; huge
    /// pages once the run is filled, whatever the kernel could give at first touch.
    pub fn build(len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Huge<T> {
        Self::build_in(&WEIGHTS, len, fill)
    }

    fn build_in(arena: &Arena, len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Huge<T> {
        let bytes = len * std::mem::size_of::<T>();
        assert!(std::mem::align_of::<T>() <= ALIGN, "Huge: values aligned to more than a cache line");
        if bytes < MIN_BYTES {
            let mut v = Vec::with_capacity(len);
            fill(&mut v.spare_capacity_mut()[..len]);
            // SAFETY: `fill` wrote every element.
            unsafe { v.set_len(len) };
            return Huge { home: Home::Heap(v) };
        }
        let (chunk, at) = arena.take(bytes);
        // SAFETY: `at..at + bytes` of the chunk is this value's alone, aligned for `T`.
        let ptr = unsafe { chunk.base.add(at) }.cast::<T>();
        // SAFETY: as above; `MaybeUninit` needs no initialised contents.
        fill(unsafe { std::slice::from_raw_parts_mut(ptr.cast::<MaybeUninit<T>>(), len) });
        super::pages::collapse(ptr as *const u8, bytes);
        Huge { home: Home::Chunk { chunk, at, bytes, ptr: NonNull::new(ptr).expect("a mapping is not null"), len } }
    }
}

/// One mapping, and the runs of it no weight holds (offset, bytes; sorted, never adjacent).
struct Chunk {
    base: *mut u8,
    len: usize,
    free: Mutex<Vec<(usize, usize)>>,
}

// SAFETY: `base` is only dereferenced through the runs handed out, each owned by one `Huge`.
unsafe impl Send for Chunk {}
unsafe impl Sync for Chunk {}

/// Every chunk still holding a weight (dropped ones fail to upgrade and are pruned), and the
/// size of a new chunk.
struct Arena(Mutex<Vec<Weak<Chunk>>>, usize);

/// The process's weights.
static WEIGHTS: Arena = Arena(Mutex::new(Vec::new()), CHUNK);

impl Arena {
    /// A run of `bytes`: the first fit in a chunk, else a new chunk.
    fn take(&self, bytes: usize) -> (Arc<Chunk>, usize) {
        let mut chunks = self.0.lock().unwrap_or_else(|e| e.into_inner());
        chunks.retain(|c| c.strong_count() > 0);
        for c in chunks.iter().filter_map(Weak::upgrade) {
            if let Some(at) = c.first_fit(bytes) {
                return (c, at);
            }
        }
        let need = bytes.next_multiple_of(HUGE);
        // A strict overcommit policy may refuse the reservation; then just what is needed.
        let chunk = Arc::new(Chunk::map(need.max(self.1)).or_else(|| Chunk::map(need)).unwrap_or_else(|| {
            std::alloc::handle_alloc_error(std::alloc::Layout::from_size_align(need, HUGE).expect("a huge page is a power of two"))
        }));
        let at = chunk.first_fit(bytes).expect("a new chunk holds the run it was made for");
        chunks.push(Arc::downgrade(&chunk));
        (chunk, at)
    }
}

impl Chunk {
    fn map(len: usize) -> Option<Chunk> {
        Some(Chunk { base: map_aligned(len)?, len, free: Mutex::new(vec![(0, len)]) })
    }

    /// The start of a run of `bytes` (rounded up to `ALIGN`), the first free one it fits.
    fn first_fit(&self, bytes: usize) -> Option<usize> {
        let bytes = bytes.next_multiple_of(ALIGN);
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let i = free.iter().position(|&(_, n)| n >= bytes)?;
        let (at, n) = free[i];
        match n == bytes {
            true => _ = free.remove(i),
            false => free[i] = (at + bytes, n - bytes),
        }
        Some(at)
    }

    /// Returns a run `first_fit` gave, merged with the free runs either side.
    fn give_back(&self, at: usize, bytes: usize) {
        let bytes = bytes.next_multiple_of(ALIGN);
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let i = free.partition_point(|&(a, _)| a < at);
        free.insert(i, (at, bytes));
        if i + 1 < free.len() && free[i].0 + free[i].1 == free[i + 1].0 {
            free[i].1 += free.remove(i + 1).1;
        }
        let mut merged = i;
        if i > 0 && free[i - 1].0 + free[i - 1].1 == free[i].0 {
            free[i - 1].1 += free.remove(i).1;
            merged = i - 1;
        }
        // The whole huge pages of the merged run that the freed run touches go back to the
        // system (a joined weight's parts are freed once it is made: 25 MiB for a 3B model's
        // last gate/up pair would stay resident otherwise); they fault back in, zeroed and
        // huge, when reused. Pages away from it were given back with their own runs (or never
        // touched: the tail of a 1 GiB chunk).
        let (run, len) = free[merged];
        let lo = run.max(at / HUGE * HUGE);
        let hi = (run + len).min((at + bytes).next_multiple_of(HUGE));
        // SAFETY: `lo..hi` lies inside the merged run, in this chunk's mapping, held by no `Huge`.
        super::pages::discard(unsafe { self.base.add(lo) }, hi - lo);
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        unmap(self.base, self.len);
    }
}

/// `len` bytes (a multiple of `HUGE`) of fresh zeroed memory on a `HUGE` boundary, advised
/// onto huge pages before any is touched; `None` if the system refuses.
#[cfg(unix)]
fn map_aligned(len: usize) -> Option<*mut u8> {
    // SAFETY: an anonymous private mapping of `len + HUGE` bytes, then its unaligned head and
    // the tail past `len` unmapped: what is left is `len` bytes on a `HUGE` boundary.
    unsafe {
        // No reservation of swap for the untouched address space (a strict overcommit policy
        // ignores the flag; the mapping then fails as any allocation would).
        let raw = libc::mmap(std::ptr::null_mut(), len + HUGE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE, -1, 0);
        if raw == libc::MAP_FAILED {
            return None;
        }
        let raw = raw as usize;
        let base = raw.next_multiple_of(HUGE);
        if base > raw {
            libc::munmap(raw as *mut libc::c_void, base - raw);
        }
        let end = raw + len + HUGE;
        if end > base + len {
            libc::munmap((base + len) as *mut libc::c_void, end - base - len);
        }
        super::pages::advise_huge(base as *const u8, len);
        Some(base as *mut u8)
    }
}

#[cfg(unix)]
fn unmap(base: *mut u8, len: usize) {
    // SAFETY: `base..base + len` is a mapping `map_aligned` made, and nothing refers to it now.
    unsafe { libc::munmap(base as *mut libc::c_void, len) };
}

#[cfg(not(unix))]
fn map_aligned(len: usize) -> Option<*mut u8> {
    let layout = std::alloc::Layout::from_size_align(len, HUGE).ok()?;
    // SAFETY: a non-zero size.
    let p = unsafe { std::alloc::alloc(layout) };
    (!p.is_null()).then_some(p)
}

#[cfg(not(unix))]
fn unmap(base: *mut u8, len: usize) {
    // SAFETY: allocated by `map_aligned` with this layout.
    unsafe { std::alloc::dealloc(base, std::alloc::Layout::from_size_align(len, HUGE).expect("a huge page is a power of two")) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests' own arena: others running at the same time do not take runs of it.
    static TESTS: Arena = Arena(Mutex::new(Vec::new()), CHUNK_T);
    const CHUNK_T: usize = 8 << 20;

    fn filled(len: usize, v: u32) -> Huge<u32> {
        Huge::build_in(&TESTS, len, |s| s.iter_mut().for_each(|x| _ = x.write(v)))
    }

    /// Runs are carved and given back first fit, merged with their neighbours, and a chunk
    /// whose weights are all gone is unmapped; values read back as written; small ones stay
    /// on the heap.
    #[test]
    fn weights_share_chunks_and_free_runs_are_reused() {
        let quarter = CHUNK_T / 4 / 4; // u32s in a quarter of a chunk
        let a = filled(quarter, 1);
        let b = filled(quarter, 2);
        let c = filled(quarter, 3);
        let chunk_of = |h: &Huge<u32>| match &h.home {
            Home::Chunk { chunk, at, .. } => (Arc::as_ptr(chunk), *at),
            Home::Heap(_) => panic!("{h:?}"),
        };
        let (ca, at_a) = chunk_of(&a);
        assert_eq!(chunk_of(&b), (ca, at_a + CHUNK_T / 4));
        assert_eq!(chunk_of(&c).0, ca);
        assert!(a.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2) && c.iter().all(|&x| x == 3));
        assert_eq!(a.as_ptr() as usize % HUGE, 0, "a chunk starts on a huge page");
        // a and b freed: their runs merge, and a half-chunk weight fits where they were.
        drop((a, b));
        let d = filled(2 * quarter, 4);
        assert_eq!(chunk_of(&d), (ca, at_a));
        assert!(d.iter().all(|&x| x == 4) && c.iter().all(|&x| x == 3));
        // Larger than a chunk: a chunk of its own, rounded to huge pages.
        let big = filled(CHUNK_T / 4 + 1, 5);
        assert_ne!(chunk_of(&big).0, ca);
        let weak = match &big.home {
            Home::Chunk { chunk, .. } => Arc::downgrade(chunk),
            Home::Heap(_) => unreachable!(),
        };
        drop(big);
        assert!(weak.upgrade().is_none(), "a chunk goes with its last weight");
        let small = filled(10, 6);
        assert!(matches!(small.home, Home::Heap(_)) && small.iter().all(|&x| x == 6));
    }

    /// A chunk's free runs stay sorted and merge with a freed neighbour on either side, in
    /// any order of release; sizes round up to cache lines.
    #[test]
    fn free_runs_merge_on_both_sides() {
        let c = Chunk::map(HUGE).expect("2 MiB");
        let free = || c.free.lock().unwrap().clone();
        let runs: Vec<usize> = (0..4).map(|_| c.first_fit(1000).unwrap()).collect();
        assert_eq!(runs, [0, 1024, 2048, 3072]);
        c.give_back(1024, 1000);
        c.give_back(3072, 1000);
        assert_eq!(free(), [(1024, 1024), (3072, HUGE - 3072)]);
        c.give_back(2048, 1000); // between two free runs
        assert_eq!(free(), [(1024, HUGE - 1024)]);
        assert_eq!(c.first_fit(HUGE), None);
        c.give_back(0, 1000); // before one
        assert_eq!(free(), [(0, HUGE)]);
        assert_eq!(c.first_fit(HUGE), Some(0));
        assert_eq!(free(), []);
    }
}
