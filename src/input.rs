//! Reading input files defensively. Every file merg reads is first checked to be a regular
//! file (a FIFO would block forever, `/dev/zero` never ends, a directory is a mistake), and
//! read with a size cap that is generous for real data and stated in the error, with the
//! environment variable that raises it. Library errors name the file and the limit.

use std::fs::{File, Metadata};
use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// A kind of input and its size cap.
#[derive(Clone, Copy, Debug)]
pub struct Kind {
    /// What the file is, for messages ("dialogue", "model config").
    pub what: &'static str,
    /// Default cap in MiB.
    pub mib: u64,
    /// Environment variable overriding the cap (MiB).
    pub env: &'static str,
}

pub const DIALOGUE: Kind = Kind { what: "dialogue", mib: 64, env: "MERG_MAX_DIALOGUE_MIB" };
pub const MEMORY: Kind = Kind { what: "exemplar memory", mib: 1024, env: "MERG_MAX_MEMORY_MIB" };
pub const CONFIG: Kind = Kind { what: "config file", mib: 64, env: "MERG_MAX_CONFIG_MIB" };
pub const TOKENIZER: Kind = Kind { what: "tokenizer", mib: 512, env: "MERG_MAX_TOKENIZER_MIB" };
pub const TEMPLATE: Kind = Kind { what: "template", mib: 4, env: "MERG_MAX_TEMPLATE_MIB" };
pub const DATASET: Kind = Kind { what: "dataset file", mib: 2048, env: "MERG_MAX_DATASET_MIB" };
/// Audio files (a turn's `"audio"`): read whole by the WAV reader, streamed by ffmpeg.
pub const AUDIO: Kind = Kind { what: "audio", mib: 1024, env: "MERG_MAX_AUDIO_MIB" };
pub const IMAGE: Kind = Kind { what: "image", mib: 256, env: "MERG_MAX_IMAGE_MIB" };
pub const RECORDS: Kind = Kind { what: "run file", mib: 4096, env: "MERG_MAX_RECORDS_MIB" };
/// Videos are streamed by ffmpeg, never read whole; only the regular-file check applies.
pub const VIDEO: Kind = Kind { what: "video", mib: 1 << 20, env: "MERG_MAX_VIDEO_MIB" };
/// Weights are memory-mapped, never read whole; only the regular-file check applies.
pub const WEIGHTS: Kind = Kind { what: "weights", mib: 1 << 30, env: "MERG_MAX_WEIGHTS_MIB" };
pub const TEXT: Kind = Kind { what: "text file", mib: 16, env: "MERG_MAX_TEXT_MIB" };
/// A benchmark's saved JSON, drawn by `merg plot`.
pub const BENCH_JSON: Kind = Kind { what: "benchmark JSON", mib: 64, env: "MERG_MAX_BENCH_JSON_MIB" };

impl Kind {
    /// The cap in bytes (the environment variable wins when it is a number).
    pub fn limit(&self) -> u64 {
        let mib = std::env::var(self.env).ok().and_then(|v| v.trim().parse::<u64>().ok()).unwrap_or(self.mib);
        mib.saturating_mul(1 << 20)
    }

    pub fn too_big(&self, path: &Path, size: u64) -> anyhow::Error {
        anyhow::anyhow!(
            "{} {} is {:.1} MiB; the limit is {} MiB (raise it with {}=<MiB>)",
            self.what,
            path.display(),
            size as f64 / (1u64 << 20) as f64,
            self.limit() >> 20,
            self.env
        )
    }
}

/// The file's metadata if it is a regular file; otherwise an error saying what it is.
pub fn regular_file(path: &Path, kind: &Kind) -> Result<Metadata> {
    let meta = std::fs::metadata(path).with_context(|| format!("{} {}", kind.what, path.display()))?;
    if !meta.is_file() {
        bail!("{} {} is not a regular file ({})", kind.what, path.display(), describe(&meta));
    }
    Ok(meta)
}

fn describe(meta: &Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_fifo() {
            return "a FIFO: reading it could block forever";
        }
        if t.is_char_device() || t.is_block_device() {
            return "a device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if meta.is_dir() {
        "a directory"
    } else {
        "not a plain file"
    }
}

/// A regular file within its cap, opened for streaming reads; the reader fails (instead of
/// growing without end) if the file grows past the cap while it is read.
pub fn open(path: &Path, kind: &Kind) -> Result<Capped<File>> {
    let meta = regular_file(path, kind)?;
    let limit = kind.limit();
    if meta.len() > limit {
        return Err(kind.too_big(path, meta.len()));
    }
    let f = File::open(path).with_context(|| format!("opening {} {}", kind.what, path.display()))?;
    Ok(Capped { inner: f, left: limit, what: format!("{} {}", kind.what, path.display()), limit })
}

/// The whole file, within its cap.
pub fn read(path: &Path, kind: &Kind) -> Result<Vec<u8>> {
    let mut buf = vec![];
    open(path, kind)?.read_to_end(&mut buf).with_context(|| format!("reading {} {}", kind.what, path.display()))?;
    Ok(buf)
}

/// The whole file as UTF-8 text, within its cap.
pub fn read_string(path: &Path, kind: &Kind) -> Result<String> {
    let bytes = read(path, kind)?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!("{} {}: not UTF-8 text (invalid byte at offset {})", kind.what, path.display(), e.utf8_error().valid_up_to())
    })
}

/// A reader that errors once more than `limit` bytes have been read.
pub struct Capped<R> {
    inner: R,
    left: u64,
    limit: u64,
    what: String,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            // One probe byte tells a file that ends exactly at the cap from one that goes on.
            let mut probe = [0u8; 1];
            return match self.inner.read(&mut probe)? {
                0 => Ok(0),
                _ => Err(std::io::Error::other(format!("{} grew past its limit of {} MiB while being read", self.what, self.limit >> 20))),
            };
        }
        let n = buf.len().min(self.left.min(usize::MAX as u64) as usize);
        let got = self.inner.read(&mut buf[..n])?;
        self.left -= got as u64;
        Ok(got)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_fifos_and_directories_are_refused_by_name() {
        let e = read(Path::new("/dev/zero"), &DIALOGUE).unwrap_err().to_string();
        assert!(e.contains("dialogue /dev/zero is not a regular file (a device)"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let e = read(dir.path(), &CONFIG).unwrap_err().to_string();
        assert!(e.contains("is not a regular file (a directory)"), "{e}");
        #[cfg(unix)]
        {
            let fifo = dir.path().join("pipe");
            assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
            let e = read(&fifo, &DIALOGUE).unwrap_err().to_string();
            assert!(e.contains("a FIFO"), "{e}");
        }
    }

    #[test]
    fn the_cap_is_stated_with_its_variable() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.txt");
        std::fs::write(&p, vec![b'a'; (1 << 20) + 10]).unwrap();
        let kind = Kind { what: "test file", mib: 1, env: "MERG_TEST_CAP_UNSET_MIB" };
        let e = read(&p, &kind).unwrap_err().to_string();
        assert!(e.contains("is 1.0 MiB; the limit is 1 MiB (raise it with MERG_TEST_CAP_UNSET_MIB=<MiB>)"), "{e}");
        std::fs::write(&p, b"ok").unwrap();
        assert_eq!(read_string(&p, &kind).unwrap(), "ok");
    }

    #[test]
    fn a_reader_past_its_cap_fails() {
        let mut c = Capped { inner: std::io::repeat(7), left: 10, limit: 10, what: "stream".into() };
        let mut buf = vec![];
        let e = c.read_to_end(&mut buf).unwrap_err();
        assert!(e.to_string().contains("grew past its limit"), "{e}");
        assert_eq!(buf.len(), 10);
    }
}
