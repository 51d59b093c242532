//! Every value that becomes a path in the Hub cache is checked here before
//! anything is written, and the cache's files are written and deleted only
//! through these helpers: writes never follow a link, deletes remove the
//! entry inside the cache (a link itself, never what it points to).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Whether `s` is 40 hex digits (a git commit id).
pub fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Whether `s` is 64 hex digits (a sha256, the blob name of an LFS file).
pub fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A commit id as the server sent it (model info `sha`, `X-Repo-Commit`),
/// lowercased, or `None` when it is not 40 hex digits.
pub fn commit(value: &str) -> Option<String> {
    let v = value.trim();
    is_commit(v).then(|| v.to_ascii_lowercase())
}

/// The blob name an `ETag` / `X-Linked-Etag` header stands for, or `None`
/// when it is not one of the hash forms the Hub sends: a sha256 (LFS files)
/// or a 40-hex git blob id, optionally quoted and optionally weak (`W/`).
pub fn etag(raw: &str) -> Option<String> {
    let v = raw.trim();
    let v = v.strip_prefix("W/").unwrap_or(v);
    let v = match v.strip_prefix('"') {
        Some(inner) => inner.strip_suffix('"')?,
        None => v,
    };
    (is_commit(v) || is_sha256(v)).then(|| v.to_ascii_lowercase())
}

/// Checks a `--revision` (branch, tag, commit or `refs/pr/N`): it is used
/// as a path under `refs/`, so it must stay a plain relative path there.
/// Git's own ref-name rules forbid all of these too.
pub fn check_revision(rev: &str) -> Result<()> {
    match revision_problem(rev) {
        Some(why) => bail!("--revision {rev:?} is not a branch, tag or commit: {why}"),
        None => Ok(()),
    }
}

/// Why `rev` cannot be a revision name ([`check_revision`]), if it cannot.
pub fn revision_problem(rev: &str) -> Option<&'static str> {
    if rev.is_empty() {
        Some("it is empty")
    } else if rev.len() > 255 {
        Some("it is longer than 255 bytes")
    } else if rev.starts_with('/') {
        Some("it starts with `/`")
    } else if rev.chars().any(|c| {
        c.is_control() || c.is_whitespace() || matches!(c, '\\' | ':' | '~' | '^' | '?' | '*' | '[')
    }) {
        Some("it holds a character git refuses in a ref name")
    } else if rev
        .split('/')
        .any(|p| p.is_empty() || p == "." || p == ".." || p.starts_with('.'))
    {
        Some("a part of it is empty or starts with `.`")
    } else {
        None
    }
}

/// Checks a file name of the repository (a path relative to the snapshot,
/// e.g. a shard name from the index): plain components only.
pub fn check_file_name(name: &str) -> Result<()> {
    let plain = !name.is_empty()
        && name.len() <= 1024
        && !name.starts_with('/')
        && !name.chars().any(|c| c.is_control() || c == '\\')
        && name
            .split('/')
            .all(|p| !p.is_empty() && p != "." && p != "..")
        && Path::new(name)
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
    if !plain {
        bail!("file name {name:?} is not a plain relative path inside the repository");
    }
    Ok(())
}

/// The relative link target of a snapshot entry `name` for blob `blob`:
/// `../../blobs/<blob>`, one more `../` per directory level of `name`.
pub fn blob_link_target(name: &str, blob: &str) -> PathBuf {
    let mut t = PathBuf::new();
    for _ in 0..name.split('/').count() + 1 {
        t.push("..");
    }
    t.join("blobs").join(blob)
}

/// The blob name a snapshot entry links to, when the link has the cache's
/// own shape (`../`s, `blobs`, a hash); `None` for anything else.
pub fn linked_blob(pointer: &Path) -> Option<String> {
    let target = std::fs::read_link(pointer).ok()?;
    let mut comps: Vec<Component> = target.components().collect();
    let Some(Component::Normal(blob)) = comps.pop() else {
        return None;
    };
    let Some(Component::Normal(dir)) = comps.pop() else {
        return None;
    };
    let blob = blob.to_str()?;
    let shaped = dir == "blobs"
        && !comps.is_empty()
        && comps.iter().all(|c| matches!(c, Component::ParentDir))
        && (is_sha256(blob) || is_commit(blob));
    shaped.then(|| blob.to_ascii_lowercase())
}

/// Removes a damaged snapshot entry and, when it links to a blob of this
/// repository's `blobs/`, that blob entry. A link to anywhere else is
/// removed without touching its target.
pub fn remove_snapshot_entry(repo_dir: &Path, pointer: &Path) {
    if let Some(blob) = linked_blob(pointer) {
        let _ = std::fs::remove_file(repo_dir.join("blobs").join(blob));
    }
    let _ = std::fs::remove_file(pointer);
}

/// Opens `path` for reading and writing, creating it, without following a
/// link at its last component.
pub fn open_nofollow(path: &Path, truncate: bool) -> Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create(true).truncate(truncate);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    }
    #[cfg(not(unix))]
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
        let _ = std::fs::remove_file(path);
    }
    o.open(path)
        .with_context(|| format!("cannot open {} for writing", path.display()))
}

/// Writes a small file (a ref, a verification marker) without following a
/// link at its last component: the new bytes go to a fresh file renamed
/// over it.
pub fn write_nofollow(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_file_name(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file"),
        std::process::id()
    ));
    let mut f = open_nofollow(&tmp, true)?;
    f.write_all(bytes)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    drop(f);
    std::fs::rename(&tmp, path).with_context(|| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot write {}", path.display())
    })
}

/// Points snapshot entry `pointer` (file `name`) at blob `blob`, replacing
/// whatever entry was there (the entry itself, not a link's target).
pub fn link_snapshot(pointer: &Path, name: &str, blob: &str) -> Result<()> {
    if let Some(parent) = pointer.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    if std::fs::symlink_metadata(pointer).is_ok() {
        std::fs::remove_file(pointer)
            .with_context(|| format!("cannot replace {}", pointer.display()))?;
    }
    let target = blob_link_target(name, blob);
    #[cfg(unix)]
    std::os::unix::fs::symlink(&target, pointer)
        .with_context(|| format!("cannot link {}", pointer.display()))?;
    // Links need privileges elsewhere: a copy keeps the layout readable.
    #[cfg(not(unix))]
    std::fs::copy(
        pointer.parent().unwrap_or(Path::new(".")).join(&target),
        pointer,
    )
    .map(|_| ())
    .with_context(|| format!("cannot copy the blob to {}", pointer.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etags_take_only_hash_forms() {
        let sha = "a".repeat(64);
        let git = "0123456789abcdef0123456789abcdef01234567";
        assert_eq!(etag(&format!("\"{sha}\"")), Some(sha.clone()));
        assert_eq!(etag(&format!("W/\"{git}\"")), Some(git.to_string()));
        assert_eq!(etag(git), Some(git.to_string()));
        assert_eq!(etag(&git.to_ascii_uppercase()), Some(git.to_string()));
        for bad in [
            "\"../../../../x\"",
            "",
            "\"\"",
            "\"abc\"",
            &format!("\"{sha}"),
            &format!("\"{}/x\"", &sha[..62]),
            &format!("\"{git}0\""),
        ] {
            assert_eq!(etag(bad), None, "{bad}");
        }
    }

    #[test]
    fn commits_are_40_hex() {
        let c = "0123456789abcdef0123456789abcdef01234567";
        assert_eq!(commit(c).as_deref(), Some(c));
        assert_eq!(commit("../../../../evil"), None);
        assert_eq!(commit(&c[..39]), None);
        assert_eq!(commit(&format!("{}/", &c[..39])), None);
    }

    #[test]
    fn revisions_stay_under_refs() {
        for ok in ["main", "release.one", "refs/pr/1", "my-branch_2"] {
            check_revision(ok).unwrap();
        }
        for bad in [
            "", "../../..", "a/../b", "/etc", "a\\b", "a\0b", "a//b", "a/", ".hidden", "C:x",
        ] {
            assert!(check_revision(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn file_names_stay_in_the_snapshot() {
        check_file_name("model-00001-of-00002.safetensors").unwrap();
        check_file_name("sub/dir/x.safetensors").unwrap();
        for bad in ["", "/x", "../x", "a/../b", "a//b", "a\\b", "a\0b", "./a"] {
            assert!(check_file_name(bad).is_err(), "{bad:?}");
        }
    }

    #[cfg(unix)]
    #[test]
    fn removing_a_link_to_outside_keeps_its_target() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("repo");
        let snap = repo.join("snapshots/c");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"user data").unwrap();
        let link = snap.join("model.safetensors");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        remove_snapshot_entry(&repo, &link);
        assert!(link.symlink_metadata().is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"user data");

        // A link of the cache's own shape takes its blob with it.
        let blob = "b".repeat(64);
        std::fs::write(repo.join("blobs").join(&blob), b"bad").unwrap();
        link_snapshot(&link, "model.safetensors", &blob).unwrap();
        assert_eq!(std::fs::read(&link).unwrap(), b"bad");
        assert_eq!(linked_blob(&link), Some(blob.clone()));
        remove_snapshot_entry(&repo, &link);
        assert!(!repo.join("blobs").join(&blob).exists());
    }

    #[cfg(unix)]
    #[test]
    fn writes_do_not_follow_links() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"user data").unwrap();
        let link = dir.path().join("ref");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert!(open_nofollow(&link, false).is_err());
        write_nofollow(&link, b"abc").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"user data");
        assert!(!link.symlink_metadata().unwrap().file_type().is_symlink());
    }
}
