//! Inline media: images as OpenAI `data:` URLs and Ollama's bare base64, and OpenAI
//! `input_audio` clips, decoded under the server's limits. The image header is read first, so an
//! oversized image is refused before a single pixel is allocated. Remote URLs are refused: the
//! server never fetches from the network.

use base64::Engine as _;
use image::RgbImage;

use super::Limits;

/// The image a `data:image/...;base64,` URL carries.
pub fn from_data_url(url: &str, what: &str, limits: &Limits) -> Result<RgbImage, String> {
    let lower = url.get(..12).unwrap_or(url).to_ascii_lowercase();
    if !lower.starts_with("data:") {
        let scheme = url.split(':').next().unwrap_or("");
        return Err(format!(
            "{what}: only inline images are accepted (data:image/...;base64,...); {scheme:?} URLs are refused because the server does not fetch from the network"
        ));
    }
    let (head, payload) = url[5..].split_once(',').ok_or_else(|| format!("{what}: a data URL needs a comma before its payload"))?;
    if !head.to_ascii_lowercase().ends_with(";base64") {
        return Err(format!("{what}: the data URL must be base64-encoded (data:image/png;base64,...), got {head:?}"));
    }
    from_base64(payload, what, limits)
}

/// A base64-encoded image file (PNG, JPEG, WebP, BMP).
pub fn from_base64(b64: &str, what: &str, limits: &Limits) -> Result<RgbImage, String> {
    let clean: String = b64.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(clean.as_bytes())
        .map_err(|e| format!("{what}: not valid base64 ({e})"))?;
    decode(&bytes, what, limits)
}

fn decode(bytes: &[u8], what: &str, limits: &Limits) -> Result<RgbImage, String> {
    crate::vision::decode_image(bytes, what, limits.max_image_pixels).map_err(|e| format!("{e:#}"))
}

/// The formats OpenAI's `input_audio.format` names (and two more ffmpeg reads). The bytes
/// decide how they are decoded (a WAV is sniffed); the name is only checked.
const AUDIO_FORMATS: [&str; 4] = ["wav", "mp3", "flac", "ogg"];

/// An OpenAI `input_audio` part (`{"data": <base64>, "format": "wav"|"mp3"}`) as 16 kHz mono.
pub fn audio_from_part(part: &serde_json::Value, what: &str) -> Result<crate::audio::Pcm, String> {
    let format = part.get("format").and_then(|f| f.as_str()).ok_or_else(|| format!("{what}: input_audio needs a string `format` (wav or mp3)"))?;
    if !AUDIO_FORMATS.contains(&format.to_ascii_lowercase().as_str()) {
        return Err(format!("{what}: input_audio.format must be one of {}, got {format:?}", AUDIO_FORMATS.join(", ")));
    }
    let data = part.get("data").and_then(|d| d.as_str()).ok_or_else(|| format!("{what}: input_audio needs base64 `data`"))?;
    let clean: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    let bytes = base64::engine::general_purpose::STANDARD.decode(clean.as_bytes()).map_err(|e| format!("{what}: input_audio.data is not valid base64 ({e})"))?;
    crate::audio::load_audio_bytes(&bytes, what).map_err(|e| e.to_string())
}

/// 400 when a request carries more audio clips than the server takes.
pub fn check_audio_count(n: usize, limits: &Limits) -> Result<(), String> {
    if n > limits.max_audio {
        return Err(format!("the request has {n} audio clips; the server's limit is {} per request", limits.max_audio));
    }
    Ok(())
}

/// 400 when a request carries more images than the server takes.
pub fn check_count(n: usize, limits: &Limits) -> Result<(), String> {
    if n > limits.max_images {
        return Err(format!("the request has {n} images; the server's limit is {} per request", limits.max_images));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32) -> String {
        let img = RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut buf = std::io::Cursor::new(vec![]);
        img.write_to(&mut buf, image::ImageFormat::Png).unwrap();
        base64::engine::general_purpose::STANDARD.encode(buf.into_inner())
    }

    #[test]
    fn data_urls_decode_and_bad_ones_say_why() {
        let l = Limits::default();
        let img = from_data_url(&format!("data:image/png;base64,{}", png(5, 3)), "image 1", &l).unwrap();
        assert_eq!(img.dimensions(), (5, 3));
        let e = from_data_url("https://example.com/a.png", "image 1", &l).unwrap_err();
        assert!(e.contains("image 1") && e.contains("\"https\"") && e.contains("network"), "{e}");
        let e = from_base64("@@@", "image 2", &l).unwrap_err();
        assert!(e.contains("image 2") && e.contains("base64"), "{e}");
        let e = from_base64(&base64::engine::general_purpose::STANDARD.encode(b"not an image"), "image 3", &l).unwrap_err();
        assert!(e.contains("image 3") && e.contains("image"), "{e}");
        let small = Limits { max_image_pixels: 10, ..Limits::default() };
        let e = from_base64(&png(5, 3), "image 4", &small).unwrap_err();
        assert!(e.contains("image 4 is 5×3 = 15 pixels") && e.contains("limit is 10 pixels"), "{e}");
        assert!(check_count(17, &l).unwrap_err().contains("limit is 16"));
    }
}
