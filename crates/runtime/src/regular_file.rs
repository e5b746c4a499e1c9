//! Reading a file an operator names (the configuration, a CA file): only a regular
//! file, and only so much of it.
//!
//! Invariants:
//! - Only a regular file is read. A FIFO, a device, a socket or a directory is refused
//!   before a byte is read, naming what it is: opening a FIFO blocks until a writer
//!   comes, and reading `/dev/zero` fills memory, so a path given by mistake would hang
//!   a command (or a start) instead of failing it. The file is opened without blocking
//!   and its type is taken from the open file, not from the path.
//! - At most `max_bytes` are read: a larger file is refused, not truncated.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The bytes of the regular file at `path`, at most `max_bytes` of them.
pub fn read(path: &Path, max_bytes: u64) -> std::io::Result<Vec<u8>> {
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    if let Some(what) = ingest::state::not_a_regular_file(file.metadata()?.file_type()) {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("it is {what}, not a regular file")));
    }
    let mut bytes = Vec::new();
    file.take(max_bytes.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max_bytes {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("it is larger than {max_bytes} bytes"),
        ));
    }
    Ok(bytes)
}

/// [`read`], as UTF-8 text.
pub fn read_text(path: &Path, max_bytes: u64) -> std::io::Result<String> {
    String::from_utf8(read(path, max_bytes)?)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "stream did not contain valid UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO, a directory and a device are refused at once, each named; a regular file
    /// is read up to its bound and refused past it.
    #[test]
    fn only_a_regular_file_within_its_bound_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo(3) with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for (path, what) in
            [(fifo.as_path(), "a FIFO"), (dir.path(), "a directory"), (Path::new("/dev/zero"), "a device")]
        {
            let e = read(path, 1 << 20).expect_err(what);
            assert!(e.to_string().contains(what), "{}: {e}", path.display());
        }
        let file = dir.path().join("config.toml");
        std::fs::write(&file, "0123456789").unwrap();
        assert_eq!(read_text(&file, 10).unwrap(), "0123456789");
        assert!(read(&file, 9).unwrap_err().to_string().contains("larger than 9 bytes"));
    }
}
