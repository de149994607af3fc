//! `scripts/install-deps.sh` detection, run in dry-run mode against fake library trees: it must
//! look for the libclang that bindgen loads (not llvm's libclang-cpp) and for ffmpeg through
//! pkg-config, and without a way to install it must name the packages and fail.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const AV_LIBS: [&str; 7] = [
    "libavcodec",
    "libavformat",
    "libavutil",
    "libswscale",
    "libavdevice",
    "libavfilter",
    "libswresample",
];

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/install-deps.sh")
}

/// A pkg-config directory holding `.pc` files for the given libraries.
fn pc_dir(root: &Path, libs: &[&str]) -> PathBuf {
    let dir = root.join("pkgconfig");
    std::fs::create_dir_all(&dir).unwrap();
    for lib in libs {
        let pc = format!("Name: {lib}\nDescription: fake\nVersion: 60.0.0\nLibs: -l{lib}\n");
        std::fs::write(dir.join(format!("{lib}.pc")), pc).unwrap();
    }
    dir
}

/// A library directory holding empty files with the given names.
fn lib_dir(root: &Path, files: &[&str]) -> PathBuf {
    let dir = root.join("lib");
    std::fs::create_dir_all(&dir).unwrap();
    for f in files {
        std::fs::write(dir.join(f), b"").unwrap();
    }
    dir
}

fn dry_run(libdir: &Path, pcdir: &Path) -> String {
    dry_run_with_python(libdir, pcdir, "python3")
}

fn dry_run_with_python(libdir: &Path, pcdir: &Path, python: &str) -> String {
    let out = Command::new("bash")
        .arg(script())
        .arg("--dry-run")
        .env("MERG_LIBCLANG_DIRS", libdir)
        .env("PKG_CONFIG_LIBDIR", pcdir)
        .env("MERG_PYTHON3", python)
        .output()
        .unwrap();
    assert!(out.status.success(), "dry run failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The dry-run tests read fake `.pc` files through pkg-config; without it they say so and pass.
fn no_pkg_config() -> bool {
    let absent = Command::new("pkg-config").arg("--version").output().is_err();
    if absent {
        eprintln!("SKIPPED: pkg-config absent (the script would install it first)");
    }
    absent
}

#[test]
fn libclang_cpp_alone_is_not_libclang() {
    if no_pkg_config() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let out = dry_run(&lib_dir(t.path(), &["libclang-cpp.so.14"]), &pc_dir(t.path(), &AV_LIBS));
    assert_eq!(out.trim(), "would install: clang libclang-dev");
}

#[test]
fn versioned_libclang_needs_nothing() {
    if no_pkg_config() {
        return;
    }
    for name in ["libclang.so.1", "libclang-14.so.1", "libclang.so", "libclang-16.so"] {
        let t = tempfile::tempdir().unwrap();
        let libs = lib_dir(t.path(), &["libclang-cpp.so.14", name]);
        assert_eq!(dry_run(&libs, &pc_dir(t.path(), &AV_LIBS)).trim(), "nothing to install", "{name}");
    }
}

#[test]
fn python_without_venv_is_named() {
    if no_pkg_config() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let libs = lib_dir(t.path(), &["libclang.so.1"]);
    // `false` stands for a python whose `import venv, ensurepip` fails (Debian without python3-venv).
    let out = dry_run_with_python(&libs, &pc_dir(t.path(), &AV_LIBS), "false");
    assert_eq!(out.trim(), "would install: python3 python3-venv");
}

#[test]
fn missing_ffmpeg_libraries_are_named() {
    if no_pkg_config() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let libs = lib_dir(t.path(), &["libclang.so.1"]);
    let pcs = pc_dir(t.path(), &["libavcodec", "libavformat", "libavutil", "libswscale"]);
    assert_eq!(
        dry_run(&libs, &pcs).trim(),
        "would install: libavdevice-dev libavfilter-dev libswresample-dev"
    );
}

/// Runs the script for real (no dry run) with PATH limited to `bin`, which holds `id` reporting a
/// non-root user plus whatever `extra` names (each a script that must never be called).
fn run_unprivileged(extra: &[&str]) -> Output {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let bin = t.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let mut tools = vec![("id", "#!/bin/sh\necho 1000\n".to_string())];
    for name in extra {
        let trap = format!("#!/bin/sh\necho '{name} must not be called' >&2\nexit 99\n");
        tools.push((name, trap));
    }
    for (name, body) in tools {
        let p = bin.join(name);
        std::fs::write(&p, body).unwrap();
        Command::new("chmod").arg("+x").arg(&p).status().unwrap();
    }
    // basename is the only external command the script needs besides the ones faked here.
    std::os::unix::fs::symlink(which("basename"), bin.join("basename")).unwrap();
    let out = Command::new(which("bash"))
        .arg(script())
        .env_clear()
        .env("PATH", &bin)
        .env("MERG_LIBCLANG_DIRS", t.join("nolib"))
        .output()
        .unwrap();
    out
}

fn which(tool: &str) -> PathBuf {
    let out = Command::new("sh").arg("-c").arg(format!("command -v {tool}")).output().unwrap();
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn assert_names_packages(out: &Output, reason: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(err.contains(reason), "expected '{reason}' in: {err}");
    for pkg in ["pkg-config", "libavcodec-dev", "clang", "libclang-dev"] {
        assert!(err.contains(pkg), "'{pkg}' not named in: {err}");
    }
    assert!(!err.contains("must not be called"), "{err}");
}

#[test]
fn without_root_or_sudo_it_names_the_packages_and_fails() {
    let out = run_unprivileged(&["apt-get"]);
    assert_names_packages(&out, "not running as root and sudo was not found");
}

#[test]
fn without_apt_get_it_names_the_packages_and_fails() {
    let out = run_unprivileged(&[]);
    assert_names_packages(&out, "apt-get was not found");
}

#[test]
fn unknown_argument_is_refused() {
    let out = Command::new("bash").arg(script()).arg("--yes").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--yes"));
}
