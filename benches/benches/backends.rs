//! cudarc vs cust through the same `GpuBackend`, side by side (one criterion
//! group per measure, each one generic function instantiated per driver):
//!
//! - `decode_step/<preset>`: one decode step through `Backend::step` at the
//!   0.5B and 7B shapes (synthetic weights), host clock around a call that
//!   returns only after the step's completion event;
//! - `weight_upload/0.5b`: the backend's whole weight upload (criterion's
//!   throughput; the table gives GB/s = 1e9 B/s);
//! - `launch_overhead/empty_step`: per launch, N empty steps (real parameter
//!   block, real cooperative grid, every CTA returns at once) queued back to
//!   back and closed by a stream synchronisation.
//!
//! A markdown table (each driver's event-timed `bench()` median, upload
//! GB/s, launch costs) is printed last and written to `$QMK_BENCH_TABLE`
//! when set. Without a GPU (or with the stub libcuda) it prints why and
//! skips. Presets: `QMK_BENCH_PRESETS` (default `0.5b,7b`).

use std::fmt::Write as _;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, SamplingMode, Throughput};
use qmk_benches::{
    decode_report, gpu_available, median, open, time_steps, CudarcDriver, CustDriver,
};
use qmk_engine::Backend;
use qmk_gpu::{BenchReport, Driver};
use qmk_model::{synthetic_weights, Config, Weights};

const SEED: u64 = 20261129;
const CAPACITY: usize = 512;
const FIRST_TOKEN: u32 = 9707;

#[derive(Default)]
struct Table {
    decode: Vec<(String, &'static str, BenchReport)>,
    upload: Vec<(&'static str, u64, f64)>,
    launch: Vec<(&'static str, f64, f64)>,
}

fn decode<D: Driver>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    preset: &str,
    w: &Weights,
    t: &mut Table,
) {
    let (mut b, _) = open::<D>(w, CAPACITY);
    let row = decode_report(&mut b, 16, 128);
    t.decode.push((preset.to_string(), D::NAME, row));
    let (mut pos, mut token) = (0usize, FIRST_TOKEN);
    b.reset().unwrap_or_else(|e| panic!("{}: {e}", D::NAME));
    g.bench_function(D::NAME, |bch| {
        bch.iter_custom(|iters| time_steps(&mut b, &mut pos, &mut token, iters))
    });
}

fn upload<D: Driver>(g: &mut BenchmarkGroup<'_, WallTime>, w: &Weights, bytes: u64, t: &mut Table) {
    let mut seen = Vec::new();
    g.bench_function(D::NAME, |bch| {
        bch.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let (b, took) = open::<D>(w, 64);
                drop(b);
                seen.push(bytes as f64 / took.as_secs_f64() / 1e9);
                total += took;
            }
            total
        })
    });
    t.upload.push((D::NAME, bytes, median(&mut seen)));
}

fn launch<D: Driver>(g: &mut BenchmarkGroup<'_, WallTime>, w: &Weights, t: &mut Table) {
    let (mut b, _) = open::<D>(w, 64);
    let mut empty = |n: usize| {
        b.empty_launches(n)
            .unwrap_or_else(|e| panic!("{} empty launches: {e}", D::NAME))
    };
    let _warm = empty(64);
    // Pipelined: per-launch host cost. Round trip: one launch + sync.
    let mut per = (0..5)
        .map(|_| empty(1000).as_secs_f64() * 1e6 / 1000.0)
        .collect::<Vec<_>>();
    let mut rt = (0..200)
        .map(|_| empty(1).as_secs_f64() * 1e6)
        .collect::<Vec<_>>();
    t.launch.push((D::NAME, median(&mut per), median(&mut rt)));
    g.bench_function(D::NAME, |bch| {
        bch.iter_custom(|iters| empty(iters as usize))
    });
}

fn weights(preset: &str) -> Weights {
    let config = Config::preset(preset).unwrap_or_else(|e| panic!("{preset}: {e}"));
    synthetic_weights(&config, SEED)
}

fn render(t: &Table) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "\n## Driver comparison (cudarc vs cust, one backend)\n");
    let _ = writeln!(
        s,
        "| decode step | driver | us/step median (events) | p10 | p90 | tok/s | GB/s | % of floor (stream read) | grid |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
    for (p, name, r) in &t.decode {
        let _ = writeln!(
            s,
            "| {p} | {name} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.1} % of {:.0} GB/s | {} |",
            r.us_per_step,
            r.us_p10,
            r.us_p90,
            r.tok_per_s,
            r.gbps,
            r.pct_of_floor,
            r.floor_gbps,
            r.grid
        );
    }
    let _ = writeln!(
        s,
        "\n| weight upload (0.5b) | bytes | GB/s median |\n|---|---|---|"
    );
    for (name, bytes, gbps) in &t.upload {
        let _ = writeln!(s, "| {name} | {bytes} | {gbps:.2} |");
    }
    let _ = writeln!(
        s,
        "\n| empty step | us/launch, 1000 queued + sync | us, one launch + sync |\n|---|---|---|"
    );
    for (name, per, rt) in &t.launch {
        let _ = writeln!(s, "| {name} | {per:.2} | {rt:.1} |");
    }
    s
}

fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10)
        .configure_from_args();
    if let Err(reason) = gpu_available() {
        println!("SKIPPED the GPU driver benches: {reason}");
        return;
    }
    let presets = std::env::var("QMK_BENCH_PRESETS").unwrap_or_else(|_| "0.5b,7b".into());
    let mut t = Table::default();

    let small = weights("0.5b");
    let bytes = qmk_model::weight_bytes(&small.config)
        .map(|b| b.total.0)
        .unwrap_or(0);
    {
        let mut g = c.benchmark_group("launch_overhead/empty_step");
        launch::<CudarcDriver>(&mut g, &small, &mut t);
        launch::<CustDriver>(&mut g, &small, &mut t);
        g.finish();
    }
    {
        let mut g = c.benchmark_group("weight_upload/0.5b");
        g.throughput(Throughput::Bytes(bytes));
        g.sampling_mode(SamplingMode::Flat);
        upload::<CudarcDriver>(&mut g, &small, bytes, &mut t);
        upload::<CustDriver>(&mut g, &small, bytes, &mut t);
        g.finish();
    }
    for preset in presets.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let w = if preset == "0.5b" {
            None
        } else {
            Some(weights(preset))
        };
        let w = w.as_ref().unwrap_or(&small);
        let mut g = c.benchmark_group(format!("decode_step/{preset}"));
        decode::<CudarcDriver>(&mut g, preset, w, &mut t);
        decode::<CustDriver>(&mut g, preset, w, &mut t);
        g.finish();
    }
    c.final_summary();
    let table = render(&t);
    println!("{table}");
    if let Ok(path) = std::env::var("QMK_BENCH_TABLE") {
        if let Err(e) = std::fs::write(&path, &table) {
            eprintln!("writing {path}: {e}");
        }
    }
}
