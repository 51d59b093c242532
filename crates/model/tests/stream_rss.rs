//! The streamed checkpoint path keeps file pages out of the process's
//! resident set: reading every weight of a checkpoint through
//! `CheckpointSource::read_stacked` (pread into small buffers) must not
//! grow the file-backed resident memory, while reading the same bytes
//! through the memory map does (which shows the measurement can see it).
//! One test in its own binary: no other test shares the process's counters.

use half::bf16;
use qmk_model::{Checkpoint, CheckpointSource, Config, SyntheticSource, WeightKind};

/// Resident bytes of one kind from /proc/self/status (`RssFile`, ...).
fn rss(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// File pages mapped and resident (tmpfs files count as shared memory).
fn file_backed() -> Option<u64> {
    Some(rss("RssFile:")? + rss("RssShmem:")?)
}

#[test]
fn streaming_a_checkpoint_leaves_no_file_pages_resident() {
    if file_backed().is_none() {
        eprintln!("skipped: no /proc/self/status on this system");
        return;
    }
    // About 170 MB of bf16: large next to the 1 MiB pieces and the limits.
    let mut c = Config::preset("0.5b").unwrap();
    c.num_hidden_layers = 4;
    c.vocab_size = 32768;
    let src = SyntheticSource::new(&c, 3).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let total =
        qmk_model::write_synthetic_checkpoint(dir.path(), &src, Some(50_000_000), &mut |_| {})
            .unwrap();
    assert!(total > 150_000_000, "{total}");

    let file = CheckpointSource::open(dir.path()).unwrap();
    let piece = 1 << 19; // elements: 1 MiB of bf16
    let (mut got, mut want) = (vec![bf16::ZERO; piece], vec![bf16::ZERO; piece]);
    let start = file_backed().unwrap();
    let mut read = 0u64;
    for kind in WeightKind::ALL.into_iter().filter(|k| k.present(&c)) {
        let n = kind.stacked_elems(&c).unwrap();
        let mut at = 0;
        while at < n {
            let len = (n - at).min(piece as u64) as usize;
            file.read_stacked(kind, at, &mut got[..len]).unwrap();
            src.fill(kind, at, &mut want[..len]).unwrap();
            assert!(got[..len] == want[..len], "{kind:?} at {at}");
            at += len as u64;
            read += 2 * len as u64;
        }
    }
    assert_eq!(read, total);
    let grown = file_backed().unwrap().saturating_sub(start);
    assert!(
        grown < 16 << 20,
        "streaming {total} bytes left {grown} bytes of file pages resident"
    );

    // The same bytes through the memory map do become resident.
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let mut sum = 0u64;
    for name in ckpt.names() {
        let (f, e) = ckpt.entry(name).unwrap();
        sum += f
            .data(e)
            .unwrap()
            .iter()
            .map(|&b| u64::from(b))
            .sum::<u64>();
    }
    let mapped = file_backed().unwrap().saturating_sub(start);
    assert!(
        mapped > total / 2,
        "reading through the map left only {mapped} bytes resident (sum {sum})"
    );
}
