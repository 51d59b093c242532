//! Bad-input cases the unit tests of config.rs, checkpoint.rs, chat.rs and
//! reference/ do not cover (docs/hardening.md has the whole table): each
//! expects a typed `ModelError` whose message names the file, tensor or
//! field at fault.
//!
//! Hostile inputs are bounded by counted work (instructions, bytes, items,
//! recursion depth): each test asserts the limit that trips, never a time.
//! A wall clock only guards against a hang ([`HANG_GUARD`]), with a margin
//! wide enough for a loaded machine.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::time::{Duration, Instant};

use qmk_layout::DType;
use qmk_model::chat::{
    ChatTemplate, Message, MAX_INDENT, MAX_RENDER_BYTES, MAX_SEQUENCE_ITEMS, OPERATOR_BUDGET_BYTES,
    RECURSION_LIMIT, RENDER_FUEL,
};
use qmk_model::checkpoint::save_checkpoint;
use qmk_model::fuzzing::tiny_config;
use qmk_model::tokenizer::Tokenizer;
use qmk_model::{load_weights, synthetic_weights, ModelError};

/// How long a bounded operation may run before the test calls it a hang.
/// Bounded ones end in well under a second; this is no performance check.
const HANG_GUARD: Duration = Duration::from_secs(120);

/// Runs `f` on its own thread and returns its result, failing the test if
/// it has not returned within [`HANG_GUARD`].
fn no_hang<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(HANG_GUARD) {
        Ok(Ok(v)) => v,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("{what}: no result after {HANG_GUARD:?}, taken for a hang"),
    }
}

fn assert_names(e: &ModelError, parts: &[&str]) {
    let msg = e.to_string();
    for p in parts {
        assert!(msg.contains(p), "`{msg}` should name `{p}`");
    }
}

#[test]
fn malformed_tokenizer_json_names_the_file() {
    for bytes in [
        &b"{ not json"[..],
        b"",
        b"[]",
        b"{\"model\": 3}",
        &[0xff, 0xfe, 0],
    ] {
        let e = Tokenizer::from_bytes_named(bytes, "/m/tokenizer.json").unwrap_err();
        assert!(matches!(e, ModelError::Tokenizer { .. }), "{e}");
        assert_names(&e, &["/m/tokenizer.json", "malformed tokenizer.json"]);
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), "{\"version\": \"1.0\"").unwrap();
    let e = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(e, ModelError::Tokenizer { .. }), "{e}");
    assert_names(&e, &["tokenizer.json"]);
}

#[test]
fn missing_tokenizer_json_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let e = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(e, ModelError::Tokenizer { .. }), "{e}");
    assert_names(&e, &["tokenizer.json", "cannot read"]);
}

/// A config.json claiming 2^50 layers over a 2-layer checkpoint: the check
/// stops at the first missing layer instead of listing 12 x 2^50 names
/// first (which ran out of memory before the inventory check was lazy).
#[test]
fn config_claiming_2_pow_50_layers_fails_fast_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let w = synthetic_weights(&tiny_config(true), 1);
    save_checkpoint(dir.path(), &w, DType::BF16, None).unwrap();
    let mut c = tiny_config(true);
    c.num_hidden_layers = 1 << 50;
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_string(&c).unwrap(),
    )
    .unwrap();
    let path = dir.path().to_path_buf();
    let e = no_hang("load_weights", move || {
        load_weights(&path).map(|_| ()).unwrap_err()
    });
    assert!(matches!(e, ModelError::MissingTensor { .. }), "{e}");
    assert_names(
        &e,
        &["model.safetensors", "model.layers.2.input_layernorm.weight"],
    );
}

// ---- chat templates from the internet: bounded work and output -------------

fn template(src: &str) -> ChatTemplate {
    ChatTemplate::new(src, "/m/chat_template.jinja", BTreeMap::new()).unwrap()
}

/// Compiles and renders `src`, which must fail.
fn render_err(src: &str) -> ModelError {
    let src = src.to_string();
    no_hang(&src.clone(), move || {
        template(&src)
            .render(&[Message::user("hi\nthere")], true)
            .map(|s| s.len())
            .unwrap_err()
    })
}

fn assert_limit(e: &ModelError, expect: &str) {
    match e {
        ModelError::TemplateLimit { what, origin, .. } => {
            assert!(what.contains(expect), "{e}");
            assert_eq!(origin, "/m/chat_template.jinja");
        }
        other => panic!("expected TemplateLimit ({expect}), got {other:?}"),
    }
    assert_names(e, &["/m/chat_template.jinja", "chat template", expect]);
}

#[test]
fn template_recursing_through_macros_hits_the_recursion_limit() {
    let e = render_err("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
    assert_limit(&e, "recursion depth");
    assert_names(&e, &[&RECURSION_LIMIT.to_string()]);
    // Mutual recursion too.
    let e = render_err(
        "{% macro a(n) %}{{ b(n) }}{% endmacro %}{% macro b(n) %}{{ a(n) }}{% endmacro %}{{ a(0) }}",
    );
    assert_limit(&e, "recursion depth");
}

#[test]
fn template_looping_1e9_times_runs_out_of_fuel() {
    for src in [
        // 10^7 items (the most a repeated sequence may claim) x 3 instructions.
        "{% for x in ['a'] * 10000000 %}{{ '' }}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
    ] {
        let e = render_err(src);
        assert_limit(&e, "instructions");
        assert_names(&e, &[&RENDER_FUEL.to_string()]);
    }
}

#[test]
fn template_building_huge_output_is_refused() {
    // One 10^9-byte string: minijinja refuses repeats past 10^8 bytes.
    let e = render_err("{{ 'x' * 10**9 }}");
    assert!(matches!(e, ModelError::ChatTemplate { .. }), "{e}");
    assert_names(&e, &["/m/chat_template.jinja", "too large"]);
    // 100 MB written in 1000-byte pieces: the output cap.
    let e = render_err("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}");
    assert_limit(&e, "rendered bytes");
    assert_names(&e, &[&MAX_RENDER_BYTES.to_string()]);
    // Just under the cap renders.
    let n = MAX_RENDER_BYTES / 1000;
    let s = template(&format!(
        "{{% for i in range({n}) %}}{{{{ 'x' * 1000 }}}}{{% endfor %}}"
    ))
    .render(&[], false);
    // range() itself stops at 10^5 items; either way no panic, no blow-up.
    match s {
        Ok(s) => assert_eq!(s.len(), n * 1000),
        Err(e) => assert!(matches!(e, ModelError::ChatTemplate { .. }), "{e}"),
    }
}

#[test]
fn template_asking_for_huge_indent_widths_is_refused() {
    for src in [
        "{{ messages[0].content | indent(1000000000000) }}",
        "{{ messages[0].content | indent(width=1000000000000, first=true) }}",
        "{{ messages | tojson(indent=1000000000000) }}",
    ] {
        let e = render_err(src);
        assert!(matches!(e, ModelError::ChatTemplate { .. }), "{src}: {e}");
        assert_names(&e, &["/m/chat_template.jinja", "indent width"]);
    }
    // Sensible widths behave as minijinja's own indent.
    let t = template(&format!(
        "{{{{ 'a\\nb\\n\\nc\\n' | indent({MAX_INDENT}) | length }}}}|{{{{ 'a\\n\\nb' | indent(2, true, true) }}}}"
    ));
    let out = t.render(&[], false).unwrap();
    let expect_len = 1 + 1 + MAX_INDENT + 1 + 1 + 1 + MAX_INDENT + 1;
    assert_eq!(out, format!("{expect_len}|  a\n  \n  b"));
}

/// One minijinja instruction that would allocate gigabytes (or abort the
/// process) is refused, or a minijinja panic is caught.
#[test]
fn template_calls_that_would_allocate_without_bound_are_refused() {
    for (src, needle) in [
        ("{{ (['x'] * 2000000) | map('upper') | list }}", "items"),
        ("{{ (['x'] * 2000000) | join }}", "items"),
        ("{{ (['x'] * 2000000) | tojson }}", "items"),
        ("{{ {'a': [['x'] * 2000000]} | tojson }}", "items"),
        ("{{ ', '.join(['x'] * 2000000) }}", "items"),
        ("{{ [1] | slice(10**12) | list }}", "count"),
        // Found by the chat_template fuzz target: writing a huge lazy
        // sequence ignored the output cap (hours, then out of memory).
        ("{{ {'a': [['x'] * 3000000]} }}", "`output` of more than"),
        ("{{ ['x'] * 2000000 }}", "`output` of more than"),
        ("{{ [1] | batch(10**12, 'x') | list }}", "count"),
        ("{{ '%099999999999d' | format(1) }}", "format width"),
        ("{{ '{:>99999999999}'.format(1) }}", "format width"),
        ("{{ ('x' * 10**7) | replace('', 'y' * 100) }}", "replace"),
        ("{{ ('x' * 10**7).replace('', 'y' * 100) }}", "replace"),
    ] {
        let e = render_err(src);
        assert!(matches!(e, ModelError::ChatTemplate { .. }), "{src}: {e}");
        assert_names(&e, &["/m/chat_template.jinja", needle]);
    }
}

/// The operators that build values are bounded by the patched minijinja
/// (vendor/README.md): a doubling string or sequence, many large strings,
/// or a sequence claiming 10^12 items trips the operator byte budget or the
/// item cap, and the budget is per render.
#[test]
fn template_operators_are_bounded() {
    for (src, what) in [
        // 2^60 bytes by doubling, with `~` and with `+`.
        (
            "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
            "operator bytes",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
            "operator bytes",
        ),
        // Many strings under the per-string caps: the budget is the total.
        (
            "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + ['x' * 10**7] %}{% endfor %}{{ ns.l | length }}",
            "operator bytes",
        ),
        (
            "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + [('x' * 10**6) ~ i] %}{% endfor %}{{ ns.l | length }}",
            "operator bytes",
        ),
        // Lazy sequences that claim 10^12 items: walked by `in`, `~`, `==`.
        ("{{ 'y' in ['x'] * 10**12 }}", "sequence items"),
        ("{{ (['x'] * 10**12) ~ 'y' }}", "sequence items"),
        ("{{ (['x'] * 10**12) == (['x'] * 10**12) }}", "sequence items"),
        (
            "{% set ns = namespace(l=['x']) %}{% for i in range(60) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ 'y' in ns.l }}",
            "sequence items",
        ),
        ("{{ {'a': [['x'] * 5**12]} }}", "sequence items"),
    ] {
        let e = render_err(src);
        assert_limit(&e, what);
        let limit = match what {
            "operator bytes" => OPERATOR_BUDGET_BYTES,
            _ => MAX_SEQUENCE_ITEMS,
        };
        assert_names(&e, &[&limit.to_string()]);
    }
    assert_eq!(
        MAX_SEQUENCE_ITEMS.to_string(),
        "10000000",
        "docs/hardening.md quotes this cap"
    );
    // Under the limits the operators work, and every render gets a fresh
    // budget: 10 + 20 + 30 + 40 + 50 + 60 = 210 MB of operator results per
    // render (under the 256 MiB budget), twice.
    let t = template(
        "{% set a = 'x' * 10**7 %}{% set s = a ~ a ~ a ~ a ~ a ~ a %}{{ s | length }}|{{ ['x'] * 3 }}|{{ 'y' in ['x'] * 1000 }}",
    );
    const { assert!(OPERATOR_BUDGET_BYTES > 210_000_000) };
    for _ in 0..2 {
        let out = t.render(&[], false).unwrap();
        assert!(out.starts_with("60000000|["), "{out}");
        assert!(out.ends_with("]|False"), "{out}"); // pycompat booleans
        assert_eq!(out.matches('x').count(), 3, "{out}");
    }
}

/// Every string an operator builds is charged when it is built, also when
/// the operands are constants the compiler could fold: a list of 10 MB
/// strings renders while their bytes fit [`OPERATOR_BUDGET_BYTES`] and trips
/// it at the first string past it, instead of sharing one folded string.
#[test]
fn each_built_string_is_charged_to_the_operator_budget() {
    const STRING: usize = 10_000_000;
    let fits = OPERATOR_BUDGET_BYTES / STRING;
    let list = |n: usize| {
        format!(
            "{{% set ns = namespace(l=[]) %}}{{% for i in range({n}) %}}\
             {{% set ns.l = ns.l + ['x' * {STRING}] %}}{{% endfor %}}{{{{ ns.l | length }}}}"
        )
    };
    let out = no_hang("fitting list", move || {
        template(&list(fits)).render(&[], false)
    });
    assert_eq!(out.unwrap(), fits.to_string());
    let e = render_err(&list(fits + 1));
    assert_limit(&e, "operator bytes");
    assert_names(&e, &[&OPERATOR_BUDGET_BYTES.to_string()]);

    // A `~` chain of constants is built, and charged, at render time, not
    // folded into one huge constant while the template compiles. `n` terms
    // charge the n strings plus every intermediate result (2, 3, ... n
    // strings long).
    let charged = |n: usize| STRING * (n + n * (n + 1) / 2 - 1);
    let fits = (1..)
        .take_while(|&n| charged(n) <= OPERATOR_BUDGET_BYTES)
        .last()
        .unwrap();
    let chain = |n: usize| {
        let terms = vec![format!("('x' * {STRING})"); n].join(" ~ ");
        format!("{{{{ ({terms}) | length }}}}")
    };
    let out = no_hang("fitting chain", move || {
        template(&chain(fits)).render(&[], false)
    });
    assert_eq!(out.unwrap(), (fits * STRING).to_string());
    let e = render_err(&chain(fits + 1));
    assert_limit(&e, "operator bytes");
}

/// minijinja 2.24 panics on some hostile templates when overflow checks
/// are on (as in tests and fuzzing): in its length arithmetic of a repeated
/// sequence, and in the source excerpt of an error's debug info (found by
/// the `chat_template` fuzz target). Either way the caller gets an error.
#[test]
fn minijinja_panics_become_errors() {
    // The repeat overflow now stops at the patched item cap, before the
    // arithmetic that panicked (vendor/README.md).
    let e = render_err("{{ (range(10) * 4611686018427387904) | length }}");
    assert_limit(&e, "sequence items");
    // The excerpt is no longer formatted (errors are one line), so the
    // render error arrives as itself, in every build.
    let src = "{% for in ['a'] * 0000002000 %}x in ['a'] * 0000002000 %}{% endfor %}";
    let e = template(src)
        .render(&[Message::user("hi")], true)
        .unwrap_err();
    assert!(matches!(e, ModelError::ChatTemplate { .. }), "{e:?}");
    assert_names(
        &e,
        &[
            "/m/chat_template.jinja",
            "render failed",
            "at line 1",
            "cannot unpack",
        ],
    );
    assert!(!e.to_string().contains('\n'), "{e}");
}

/// The guarded filters and methods give what minijinja's own give.
#[test]
fn guarded_filters_behave_like_minijinjas() {
    let src = "{{ messages | map(attribute='role') | join(', ') }}|\
               {{ messages | selectattr('role', 'equalto', 'user') | list | length }}|\
               {{ [3, 1, 2] | sort | list }}|{{ [3, 1, 2] | sort(reverse=true) | first }}|\
               {{ {'b': 1, 'a': 2} | dictsort }}|{{ [1, 2, 3] | batch(2, 0) | list }}|\
               {{ [1, 2, 3] | slice(2) | list }}|{{ '%05d' | format(42) }}|\
               {{ '{:>4}'.format('a') }}|{{ 'a-b' | replace('-', '+') }}|\
               {{ 'a-b'.replace('-', '+') }}|{{ ', '.join(['x', 'y']) }}|\
               {{ [1, 1, 2] | unique | list }}|{{ [1, 2] | reverse | list }}|\
               {{ [1, 2] | sum }}|{{ [1, 2] | last }}|{{ 'a\nb' | lines | list }}|\
               {{ messages | groupby('role') | length }}";
    let msgs = [Message::user("a"), Message::assistant("b")];
    let ours = template(src).render(&msgs, false).unwrap();
    let mut env = minijinja::Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    let theirs = env
        .render_str(
            src,
            minijinja::context! { messages => msgs, add_generation_prompt => false },
        )
        .unwrap();
    assert_eq!(ours, theirs);
    assert!(ours.starts_with("user, assistant|1|[1, 2, 3]|3|"), "{ours}");
}

#[test]
fn template_that_does_not_compile_names_its_file() {
    let e = ChatTemplate::new("{% for %}", "/m/chat_template.jinja", BTreeMap::new()).unwrap_err();
    assert!(matches!(e, ModelError::ChatTemplate { .. }), "{e}");
    assert_names(&e, &["/m/chat_template.jinja", "does not compile"]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), "{ nope").unwrap();
    let e = ChatTemplate::from_dir(dir.path()).unwrap_err();
    assert!(matches!(e, ModelError::ChatTemplate { .. }), "{e}");
    assert_names(&e, &["tokenizer_config.json", "invalid JSON"]);
    std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap();
    std::fs::write(
        dir.path().join("chat_template.json"),
        "{\"chat_template\": 7}",
    )
    .unwrap();
    let e = ChatTemplate::from_dir(dir.path()).unwrap_err();
    assert_names(&e, &["chat_template.json", "neither a string"]);
}

/// The limits leave real use alone: Qwen2.5's template over a conversation
/// of 20,000 messages (far more than any context holds) renders.
#[test]
fn real_template_renders_a_very_long_conversation_within_the_limits() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/qwen-tokenizer");
    let src = std::fs::read_to_string(path.join("chat_template.jinja")).unwrap();
    let t = ChatTemplate::new(src, "chat_template.jinja", BTreeMap::new()).unwrap();
    let mut msgs = vec![Message::system("You are helpful.")];
    for i in 0..10_000 {
        msgs.push(Message::user(format!("question {i}")));
        msgs.push(Message::assistant(format!("answer {i}")));
    }
    let t0 = Instant::now();
    let out = t.render(&msgs, true).unwrap();
    assert!(out.contains("answer 9999"));
    println!("20,001 messages rendered in {:?}", t0.elapsed());
}
