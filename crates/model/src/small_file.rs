//! Reading the small files of a model directory (config, generation config,
//! tokenizer, tokenizer config, chat template, sharded index): only regular
//! files, and never more than a cap, so a device or a named pipe in their
//! place is an error naming the file instead of an endless read or a hang.

use std::io::Read;
use std::path::Path;

use crate::ModelError;

/// The cap the loaders use. The largest `tokenizer.json` files on the Hub
/// are a few tens of MB; the other small files are far smaller.
pub const SMALL_FILE_CAP: u64 = 64 << 20;

/// The bytes of `path` when it is a regular file (a link to one is fine) of
/// at most `cap` bytes; an `InvalidData` error otherwise.
pub fn read_small_bytes(path: &Path, cap: u64) -> std::io::Result<Vec<u8>> {
    let not_regular = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a regular file (a device, pipe, socket or directory)",
        )
    };
    // Checked before opening: opening a named pipe waits for a writer.
    if !std::fs::metadata(path)?.is_file() {
        return Err(not_regular());
    }
    let f = std::fs::File::open(path)?;
    if !f.metadata()?.is_file() {
        return Err(not_regular());
    }
    let mut bytes = Vec::new();
    f.take(cap.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than the {cap}-byte limit for this file"),
        ));
    }
    Ok(bytes)
}

/// [`read_small_bytes`] as UTF-8 text; errors are [`ModelError::Io`]
/// naming `path`.
pub fn read_small_file(path: &Path, cap: u64) -> Result<String, ModelError> {
    let bytes = read_small_bytes(path, cap).map_err(|e| ModelError::io(path, e))?;
    String::from_utf8(bytes).map_err(|_| {
        ModelError::io(
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regular_files_up_to_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(&p, "0123456789").unwrap();
        assert_eq!(read_small_file(&p, 10).unwrap(), "0123456789");
        let e = read_small_file(&p, 9).unwrap_err().to_string();
        assert!(
            e.contains("config.json") && e.contains("9-byte limit"),
            "{e}"
        );
    }

    #[cfg(unix)]
    #[test]
    fn devices_pipes_and_directories_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        // /dev/zero never ends; it is refused before a byte is read.
        let e = read_small_file(Path::new("/dev/zero"), SMALL_FILE_CAP)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/dev/zero") && e.contains("not a regular file"),
            "{e}"
        );
        // A link named like the real file, to the device.
        let link = dir.path().join("tokenizer.json");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        for e in [
            crate::tokenizer::Tokenizer::from_file(&link)
                .err()
                .unwrap()
                .to_string(),
            crate::Config::from_file(&link).unwrap_err().to_string(),
            crate::GenerationConfig::from_file(&link)
                .unwrap_err()
                .to_string(),
        ] {
            assert!(
                e.contains("tokenizer.json") && e.contains("not a regular file"),
                "{e}"
            );
        }
        let e = read_small_file(dir.path(), 1 << 20)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a regular file"), "{e}");
        // A named pipe nobody writes to: opening it would wait forever.
        let fifo = dir.path().join("chat_template.jinja");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success());
        if made {
            for e in [
                read_small_file(&fifo, 1 << 20).unwrap_err().to_string(),
                crate::chat::ChatTemplate::from_dir(dir.path())
                    .err()
                    .unwrap()
                    .to_string(),
            ] {
                assert!(
                    e.contains("chat_template.jinja") && e.contains("not a regular file"),
                    "{e}"
                );
            }
        } else {
            eprintln!("SKIP the named-pipe case: mkfifo is not available");
        }
    }
}
