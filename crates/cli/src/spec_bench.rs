//! `qwen-mk bench --prompts FILE`: plain against speculative greedy
//! decoding of a real model on given prompts (e.g.
//! `benches/prompts/code-edit.jsonl`): decode rates, acceptance, tokens
//! per step, and a check that both outputs are the same ids (greedy
//! speculation must not change them). A difference is an error (exit 1)
//! after the report.

use std::ops::ControlFlow;
use std::path::Path;

use anyhow::{bail, Context, Result};
use qmk_engine::{Backend, Engine, GenerateOptions, Generation, Sampling, SpeculativeOptions};
use qmk_model::chat::Message;
use serde::Deserialize;

use crate::common::{
    choose_target, engine_error, model_context, open_backend, with_draft, BackendChoice, Model,
    ModelArgs, RunArgs, SpeculateArgs, SpeculateChoice,
};
use crate::output::print;
use crate::ui::Ui;

/// Most prompts one file may hold.
pub const MAX_PROMPTS: usize = 1024;

/// Largest prompts file.
const MAX_FILE_BYTES: u64 = 16 << 20;

/// One line of the prompts file: chat `messages` (rendered with the
/// model's template) or a raw `prompt`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptLine {
    /// Shown in the report.
    pub name: String,
    /// A conversation ending with the user's turn.
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    /// Text fed as-is.
    #[serde(default)]
    pub prompt: Option<String>,
}

/// Reads a prompts file: one JSON object per line, blank lines skipped.
pub fn read_prompts(path: &Path) -> Result<Vec<PromptLine>> {
    let meta = std::fs::metadata(path).with_context(|| format!("--prompts {}", path.display()))?;
    if meta.len() > MAX_FILE_BYTES {
        bail!(
            "--prompts {}: {} bytes, at most {} MiB",
            path.display(),
            meta.len(),
            MAX_FILE_BYTES >> 20
        );
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("--prompts {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let p: PromptLine = serde_json::from_str(line)
            .with_context(|| format!("--prompts {}: line {}", path.display(), i + 1))?;
        if p.messages.is_some() == p.prompt.is_some() {
            bail!(
                "--prompts {}: line {} ({}): give exactly one of `messages` and `prompt`",
                path.display(),
                i + 1,
                p.name
            );
        }
        out.push(p);
        if out.len() > MAX_PROMPTS {
            bail!(
                "--prompts {}: more than {MAX_PROMPTS} prompts",
                path.display()
            );
        }
    }
    if out.is_empty() {
        bail!("--prompts {}: no prompts", path.display());
    }
    Ok(out)
}

/// What the speculation bench needs from `bench`'s flags.
pub struct SpecBench<'a> {
    pub model: &'a str,
    pub backend: BackendChoice,
    pub prompts: &'a Path,
    pub speculate: SpeculateArgs,
    pub max_new_tokens: usize,
    pub cubin: Option<std::path::PathBuf>,
    pub json: bool,
}

/// One prompt's two runs.
struct Row {
    name: String,
    prompt_tokens: usize,
    plain: Generation,
    spec: Generation,
}

impl Row {
    fn same(&self) -> bool {
        self.plain.output_ids == self.spec.output_ids
    }
}

/// Tokens after the first and the time they took, over many runs: the
/// decode rate of all of them together.
fn rate(gens: &[&Generation]) -> f64 {
    let n: usize = gens
        .iter()
        .map(|g| g.output_ids.len().saturating_sub(1))
        .sum();
    let s: f64 = gens.iter().map(|g| g.decode.as_secs_f64()).sum();
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

pub fn run(b: SpecBench<'_>) -> Result<()> {
    let ui = Ui::new(b.json);
    b.speculate.check()?;
    if b.speculate.speculate == SpeculateChoice::Off {
        bail!("bench --prompts compares plain decoding with --speculate auto, ngram or draft, not off");
    }
    let lines = read_prompts(b.prompts)?;
    let target = choose_target(b.backend, &ui)?;
    let model = Model::open(
        &ModelArgs {
            model: b.model.to_string(),
            revision: "main".into(),
        },
        &ui,
    )?;
    let mut prompts = Vec::with_capacity(lines.len());
    for p in &lines {
        let ids = match (&p.messages, &p.prompt) {
            (Some(m), _) => model.encode_chat(&model.chat_template()?, m)?,
            (_, Some(t)) => model.tokenizer.encode(t)?,
            _ => unreachable!("read_prompts checks one is given"),
        };
        if ids.is_empty() {
            bail!("--prompts: {} encodes to no tokens", p.name);
        }
        prompts.push((p.name.clone(), ids));
    }
    let longest = prompts.iter().map(|p| p.1.len()).max().unwrap_or(1);
    let capacity = longest + b.max_new_tokens - 1;
    let (model_max, max_name) = model_context(&model.config);
    if capacity > model_max {
        bail!(
            "--prompts: the longest prompt ({longest} tokens) plus --max-new-tokens {} needs              {capacity} positions, more than the model's {max_name} ({model_max})",
            b.max_new_tokens
        );
    }
    let run = RunArgs {
        backend: b.backend,
        context: Some(capacity),
        cubin: b.cubin.clone(),
        prefill_chunk: qmk_gpu::DEFAULT_PREFILL_CHUNK,
        no_batched_prefill: false,
        tp: 1,
        tp_co_resident: false,
        quiet: b.json,
    };
    let draft = b
        .speculate
        .open_draft(&model, &target, &run, capacity, &ui)?;
    let backend = open_backend(&model, target, &run, capacity, &ui)?;
    let backend_name = backend.kind().name();
    let mut engine = with_draft(Engine::new(backend, model.config.vocab_size), draft);
    let plain_opts = GenerateOptions {
        max_new_tokens: b.max_new_tokens,
        sampling: Sampling::greedy(),
        stop_ids: model.stop_ids(),
        ignore_eos: false,
        speculation: SpeculativeOptions::off(),
    };
    let spec_opts = GenerateOptions {
        speculation: b.speculate.options(),
        ..plain_opts.clone()
    };
    let mut rows = Vec::with_capacity(prompts.len());
    for (name, ids) in prompts {
        let mut go = |opts: &GenerateOptions| {
            engine
                .generate(&ids, opts, |_| ControlFlow::Continue(()))
                .map_err(engine_error)
                .with_context(|| format!("prompt {name}"))
        };
        let plain = go(&plain_opts)?;
        let spec = go(&spec_opts)?;
        let row = Row {
            name,
            prompt_tokens: ids.len(),
            plain,
            spec,
        };
        print(&row_text(&row, b.json))?;
        rows.push(row);
    }
    let plain = rate(&rows.iter().map(|r| &r.plain).collect::<Vec<_>>());
    let spec = rate(&rows.iter().map(|r| &r.spec).collect::<Vec<_>>());
    let (proposed, accepted, steps, decoded) = rows.iter().fold((0, 0, 0, 0), |a, r| {
        let s = &r.spec.speculation;
        (
            a.0 + s.proposed,
            a.1 + s.accepted,
            a.2 + s.steps,
            a.3 + s.decoded,
        )
    });
    let differ: Vec<&str> = rows
        .iter()
        .filter(|r| !r.same())
        .map(|r| r.name.as_str())
        .collect();
    let speedup = if plain > 0.0 { spec / plain } else { 0.0 };
    let acceptance = if proposed > 0 {
        accepted as f64 / proposed as f64
    } else {
        0.0
    };
    let per_step = if steps > 0 {
        decoded as f64 / steps as f64
    } else {
        0.0
    };
    if b.json {
        let v = serde_json::json!({
            "summary": true,
            "model": model.name,
            "draft_model": b.speculate.draft_model,
            "backend": backend_name,
            "speculate": b.speculate.speculate.mode().name(),
            "prompts": rows.len(),
            "plain_tok_per_s": plain,
            "speculative_tok_per_s": spec,
            "speedup": speedup,
            "proposed": proposed,
            "accepted": accepted,
            "acceptance": acceptance,
            "tokens_per_step": per_step,
            "identical": differ.is_empty(),
        });
        print(&format!("{v}\n"))?;
    } else {
        print(&format!(
            "all {} prompts on {backend_name}: plain {plain:.2} tok/s, speculative {spec:.2} tok/s \
             ({speedup:.2}x); {accepted} of {proposed} guesses accepted ({:.1}%), {per_step:.2} \
             tokens/step; outputs identical: {}\n",
            rows.len(),
            acceptance * 100.0,
            if differ.is_empty() { "yes" } else { "NO" }
        ))?;
    }
    if !differ.is_empty() {
        bail!(
            "speculative greedy output differs from plain greedy output on {}",
            differ.join(", ")
        );
    }
    Ok(())
}

/// One prompt's report: a JSON line or a text line.
fn row_text(r: &Row, json: bool) -> String {
    let s = &r.spec.speculation;
    if json {
        let v = serde_json::json!({
            "name": r.name,
            "prompt_tokens": r.prompt_tokens,
            "plain_tokens": r.plain.output_ids.len(),
            "speculative_tokens": r.spec.output_ids.len(),
            "plain_tok_per_s": r.plain.decode_tok_per_s(),
            "speculative_tok_per_s": r.spec.decode_tok_per_s(),
            "speculation": crate::common::speculation_json(s),
            "identical": r.same(),
        });
        return format!("{v}\n");
    }
    let speedup = if r.plain.decode_tok_per_s() > 0.0 {
        r.spec.decode_tok_per_s() / r.plain.decode_tok_per_s()
    } else {
        0.0
    };
    format!(
        "{:<24} prompt {:>5} tokens, {:>4} new: plain {:>8.2} tok/s, {} {:>8.2} tok/s ({speedup:.2}x); \
         {}/{} accepted, {:.2} tokens/step, {} verifies; identical: {}\n",
        r.name,
        r.prompt_tokens,
        r.spec.output_ids.len(),
        r.plain.decode_tok_per_s(),
        s.mode.name(),
        r.spec.decode_tok_per_s(),
        s.accepted,
        s.proposed,
        s.tokens_per_step(),
        s.verifies,
        if r.same() { "yes" } else { "NO" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_repository_prompt_set_reads() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/prompts/code-edit.jsonl");
        let p = read_prompts(&path).unwrap();
        assert!(p.len() >= 8, "{}", p.len());
        assert!(p
            .iter()
            .all(|l| l.messages.as_ref().is_some_and(|m| !m.is_empty())));
        let mut names: Vec<&str> = p.iter().map(|l| l.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), p.len(), "names are unique");
    }

    #[test]
    fn bad_prompt_files_name_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("p.jsonl");
        for (text, needle) in [
            ("", "no prompts"),
            ("{\"name\": \"a\"}\n", "line 1 (a): give exactly one"),
            (
                "\n{\"name\": \"a\", \"prompt\": \"x\", \"extra\": 1}\n",
                "line 2",
            ),
            ("not json\n", "line 1"),
        ] {
            std::fs::write(&f, text).unwrap();
            let e = format!("{:#}", read_prompts(&f).unwrap_err());
            assert!(e.contains(needle), "{e}");
        }
    }
}
