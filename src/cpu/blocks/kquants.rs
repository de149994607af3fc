//! The k-quants' packed sub-block scales (Q4_K, Q5_K), read a word at a time.

/// Sub-block scales and mins of a Q4_K/Q5_K block from its 12 packed bytes, four at a time:
/// bytes 0–3 hold scales 0–3 in their low 6 bits (and the top bits of scales 4–7), bytes 4–7
/// the mins likewise, bytes 8–11 the low nibbles of scales 4–7 and, above them, of mins 4–7.
/// (ggml's `get_scale_min_k4` reads them one at a time; a test holds the two equal.)
#[inline(always)]
pub fn scales_mins(packed: &[u8]) -> ([u8; 8], [u8; 8]) {
    let word = |i: usize| u32::from_le_bytes([packed[4 * i], packed[4 * i + 1], packed[4 * i + 2], packed[4 * i + 3]]);
    let (a, b, c) = (word(0), word(1), word(2));
    let (low6, low4, top2) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    let sc_hi = (c & low4) | (((a >> 6) & top2) << 4);
    let m_hi = ((c >> 4) & low4) | (((b >> 6) & top2) << 4);
    let sc = ((a & low6) as u64 | (sc_hi as u64) << 32).to_le_bytes();
    let m = ((b & low6) as u64 | (m_hi as u64) << 32).to_le_bytes();
    (sc, m)
}
