//! Media-encoder cache: merged patch features (and an audio clip's encoder output) keyed by the
//! content hash of the source media (pixels, size, frame rate; samples for audio; the
//! preprocessor config is fixed per engine), LRU-bounded. A keyframe or a turn's audio shown to
//! five agents over several refinement rounds is encoded once.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use candle_core::Tensor;

use crate::models::MediaGrid;
use crate::vision::Media;

/// Deterministic 64-bit content hash of a media item (never 0, which means "text"). Hashing
/// the 8-bit source pixels costs a sixteenth of hashing the f32 patches they become.
pub fn content_hash(m: &Media) -> u64 {
    // SipHash with fixed keys: stable within a build, which is all an in-process cache needs.
    let mut h = std::hash::DefaultHasher::new();
    let mut frame = |img: &image::RgbImage| {
        img.dimensions().hash(&mut h);
        h.write(img.as_raw());
    };
    match m {
        Media::Image(img) => frame(img),
        Media::Video { frames, fps } => {
            for f in frames {
                frame(f);
            }
            fps.to_bits().hash(&mut h);
            frames.len().hash(&mut h);
        }
        Media::Audio(pcm) => {
            // Tagged so no image's bytes can collide with a clip's by construction.
            b"audio".hash(&mut h);
            pcm.samples.len().hash(&mut h);
            for s in &pcm.samples {
                h.write_u32(s.to_bits());
            }
        }
    }
    h.finish().max(1)
}

/// Locks a cache shared between the engine and the request preparers.
pub(crate) fn lock(c: &std::sync::Mutex<VisionCache>) -> anyhow::Result<std::sync::MutexGuard<'_, VisionCache>> {
    c.lock().map_err(|_| anyhow::anyhow!("vision cache poisoned"))
}

pub struct VisionCache {
    capacity: usize,
    tick: u64,
    map: HashMap<u64, (Tensor, MediaGrid, u64)>,
    pub hits: u64,
    pub misses: u64,
}

impl VisionCache {
    pub fn new(capacity: usize) -> Self {
        VisionCache { capacity, tick: 0, map: HashMap::new(), hits: 0, misses: 0 }
    }

    /// Features and grid of a cached item (the grid spares re-preprocessing it).
    pub fn get(&mut self, key: u64) -> Option<(Tensor, MediaGrid)> {
        self.tick += 1;
        let tick = self.tick;
        match self.map.get_mut(&key) {
            Some((t, g, last)) => {
                *last = tick;
                self.hits += 1;
                Some((t.clone(), g.clone()))
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// The grid of a cached item, without counting a hit or refreshing its age (a caller
    /// deciding whether to preprocess asks this; the engine's `get` does the counting).
    pub fn grid_of(&self, key: u64) -> Option<MediaGrid> {
        self.map.get(&key).map(|(_, g, _)| g.clone())
    }

    pub fn insert(&mut self, key: u64, features: Tensor, grid: MediaGrid) {
        if self.capacity == 0 {
            return;
        }
        if self.map.len() >= self.capacity && !self.map.contains_key(&key) {
            // Linear scan is fine: capacities are tens of entries, inserts happen per new image.
            if let Some(&old) = self.map.iter().min_by_key(|(_, (_, _, last))| *last).map(|(k, _)| k) {
                self.map.remove(&old);
            }
        }
        self.tick += 1;
        self.map.insert(key, (features, grid, self.tick));
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn lru_evicts_least_recently_used() {
        let mut c = VisionCache::new(2);
        let t = Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu).unwrap();
        let g = |n| MediaGrid::image([1, n, n]);
        c.insert(1, t.clone(), g(2));
        c.insert(2, t.clone(), g(4));
        assert_eq!(c.get(1).unwrap().1.thw, [1, 2, 2]); // 2 is now the least recently used
        c.insert(3, t, g(6));
        assert!(c.get(2).is_none());
        assert!(c.get(1).is_some() && c.get(3).is_some());
        assert_eq!((c.hits, c.misses), (3, 1));
    }

    #[test]
    fn hash_depends_on_pixels_size_and_kind() {
        let img = image::RgbImage::from_fn(4, 6, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut other = img.clone();
        other.put_pixel(1, 1, image::Rgb([9, 9, 9]));
        let wide = image::RgbImage::from_raw(6, 4, img.as_raw().clone()).unwrap();
        let h = |m: &Media| content_hash(m);
        let a = Media::Image(img.clone());
        assert_eq!(h(&a), h(&Media::Image(img.clone())));
        assert_ne!(h(&a), h(&Media::Image(other)));
        assert_ne!(h(&a), h(&Media::Image(wide)));
        let v = |fps| Media::Video { frames: vec![img.clone(), img.clone()], fps };
        assert_ne!(h(&v(2.0)), h(&v(4.0)));
        assert_ne!(h(&a), h(&v(2.0)));
    }
}
