//! The store's reserve: a file of `[store] reserve_bytes` next to the
//! database (`edgeway.db.reserve`), set aside while the disk has room and
//! given back when it fills up, so that what tasks already running record
//! (their callers see them complete) can still be committed.
//!
//! Why: a completed call whose rows only sit in memory is lost if edgeway
//! stops before the disk has room again. With the reserve released, those
//! rows are written at once; new work stays refused (the store is degraded)
//! until the reserve can be set aside again, so the space it buys goes to
//! work already acknowledged, not to more.
//!
//! Owns: the file, written with bytes that no file system compresses or
//! deduplicates away (a sparse or compressed file would reserve nothing).
//! Does not own: when it is released or set aside again (the writer, in
//! `mod.rs`).

use std::io::Write;
use std::path::{Path, PathBuf};

pub(super) struct Reserve {
    path: PathBuf,
    /// 0: no reserve (nothing to release; always "held").
    bytes: u64,
    held: bool,
}

impl Reserve {
    pub(super) fn new(db: &Path, bytes: u64) -> Reserve {
        let mut name = db.as_os_str().to_owned();
        name.push(".reserve");
        let path = PathBuf::from(name);
        if bytes == 0 {
            // None wanted now: one left by an earlier config is only waste.
            let _ = std::fs::remove_file(&path);
        }
        Reserve { path, bytes, held: bytes == 0 }
    }

    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether the reserve is set aside (or none is configured).
    pub(super) fn is_held(&self) -> bool {
        self.held
    }

    /// Sets the reserve aside, if it is not: writes the file, plus `margin`
    /// bytes given back at once (so that the disk is known to have that
    /// much room beyond the reserve). A whole file left by the last run is
    /// kept as it is. On failure (no room) nothing is left behind.
    pub(super) fn take(&mut self, margin: u64) -> std::io::Result<()> {
        if self.held {
            return Ok(());
        }
        if margin == 0 && std::fs::metadata(&self.path).is_ok_and(|m| m.len() >= self.bytes) {
            self.held = true;
            return Ok(());
        }
        // Asked again every second while the disk is full: a look first, so
        // that a full disk (an SD card, say) is not written to for nothing.
        if let Some(free) = self.path.parent().and_then(free_bytes) {
            if free < self.bytes + margin {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::StorageFull,
                    format!("{free} bytes free, {} needed", self.bytes + margin),
                ));
            }
        }
        let r = self.write(self.bytes + margin);
        if r.is_err() {
            let _ = std::fs::remove_file(&self.path);
        }
        r?;
        self.held = true;
        Ok(())
    }

    fn write(&self, total: u64) -> std::io::Result<()> {
        let mut f = std::fs::File::create(&self.path)?;
        let block = pattern();
        let mut left = total;
        while left > 0 {
            let n = left.min(block.len() as u64) as usize;
            f.write_all(&block[..n])?;
            left -= n as u64;
        }
        // The margin is given back; the rest is allocated on disk (a crash
        // after this keeps a whole reserve, see `take`).
        f.set_len(self.bytes)?;
        f.sync_all()
    }

    /// Gives the space back (the disk is full). Returns whether there was
    /// any to give.
    pub(super) fn release(&mut self) -> bool {
        if !self.held || self.bytes == 0 {
            return false;
        }
        self.held = false;
        match std::fs::remove_file(&self.path) {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, path = %self.path.display(), "cannot remove the store's reserve");
                false
            }
        }
    }
}

/// Bytes an unprivileged process may still write on the file system of
/// `dir` (`None` if it cannot be asked).
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a valid NUL-terminated path and `st` a writable
    // statvfs that the call fills in before it is read.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// 64 KiB of pseudo-random bytes (xorshift): a file of zeros may be stored
/// as nothing by a compressing file system.
fn pattern() -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut v = Vec::with_capacity(64 * 1024);
    while v.len() < 64 * 1024 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_a_whole_file_that_is_given_back_and_taken_again() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("edgeway.db");
        let mut r = Reserve::new(&db, 256 * 1024);
        let file = dir.path().join("edgeway.db.reserve");
        assert!(!r.is_held());
        r.take(0).unwrap();
        assert!(r.is_held());
        let meta = std::fs::metadata(&file).unwrap();
        assert_eq!(meta.len(), 256 * 1024);
        // Allocated, not sparse.
        use std::os::unix::fs::MetadataExt;
        assert!(meta.blocks() * 512 >= 256 * 1024, "{} blocks", meta.blocks());
        assert!(r.release());
        assert!(!file.exists());
        assert!(!r.release(), "nothing more to give");
        r.take(256 * 1024).unwrap();
        assert_eq!(std::fs::metadata(&file).unwrap().len(), 256 * 1024, "the margin is given back");
        // None configured: nothing to hold or release, and no file left.
        let mut none = Reserve::new(&db, 0);
        assert!(none.is_held() && !none.release());
        assert!(!file.exists());
    }
}
