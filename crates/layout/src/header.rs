//! Rendering a [`ModelPlan`] into the C++ header the megakernel includes.
//!
//! The header makes every shape, stride and split point a compile-time
//! constant, and re-derives each chunk's byte span and largest offset from
//! them in `static_assert`s, so a plan that disagrees with itself, or with the
//! offset width, fails to compile instead of reading a wild pointer.
//!
//! Format (everything in `namespace qmk_plan`, builtin types only, since
//! NVRTC has no `<cstdint>`):
//!
//! 1. the offset model: `kOffsetBits`, `kOffsetUnitBytes` (1 = bytes, N =
//!    N-byte vectors, 0 = elements of each tensor's dtype) and `kMaxOffset =
//!    2^kOffsetBits - 1`;
//! 2. each `(name, value)` of `consts` as `constexpr unsigned long long NAME`;
//! 3. per tensor, a namespace named after it with `kRank`, `kShape[]`,
//!    `kStride[]` (elements), `kElemBytes`, `kBytes`, `kNumChunks`,
//!    `kChunkStart[]` (`kNumChunks + 1` entries, the last one the layer
//!    count), `kChunkOffsetBytes[]` (each chunk's byte offset in the stacked
//!    tensor), `kChunkBytes[]` (each chunk's byte span from its own base),
//!    the `static_assert`s, and `QMK_PLAN_HD constexpr` lookups written with
//!    literals only, `shape(mode)`, `stride(mode)`, `chunk_start(chunk)`,
//!    `chunk_offset_bytes(chunk)`, `chunk_bytes(chunk)`, `chunk_of(layer)`,
//!    `local_layer(layer)`: device code cannot read namespace-scope
//!    `constexpr` arrays (nvcc: "undefined in device code"), but may call
//!    these with run-time arguments.
//!
//! Checked here with g++ (every preset, five offset models) and, once, with
//! nvcc 13.0 and NVRTC to sm_90 cubins on the GPU machine: NVRTC rejects
//! host-only functions, hence `QMK_PLAN_HD` on every function.
//!
//! The output depends only on the inputs, in their order: rendering the same
//! plan twice gives the same bytes.

use std::collections::BTreeSet;

use crate::{LayoutError, ModelPlan, TensorPlan};

/// Names the header itself declares at `qmk_plan` scope (or as a macro).
const RESERVED: &[&str] = &[
    "kOffsetBits",
    "kOffsetUnitBytes",
    "kMaxOffset",
    "detail",
    "qmk_plan",
    "QMK_PLAN_HD",
];

/// C++20 keywords and alternative tokens: none may name a namespace or
/// constant.
const CPP_KEYWORDS: &[&str] = &[
    "alignas",
    "alignof",
    "and",
    "and_eq",
    "asm",
    "auto",
    "bitand",
    "bitor",
    "bool",
    "break",
    "case",
    "catch",
    "char",
    "char8_t",
    "char16_t",
    "char32_t",
    "class",
    "compl",
    "concept",
    "const",
    "consteval",
    "constexpr",
    "constinit",
    "const_cast",
    "continue",
    "co_await",
    "co_return",
    "co_yield",
    "decltype",
    "default",
    "delete",
    "do",
    "double",
    "dynamic_cast",
    "else",
    "enum",
    "explicit",
    "export",
    "extern",
    "false",
    "float",
    "for",
    "friend",
    "goto",
    "if",
    "inline",
    "int",
    "long",
    "mutable",
    "namespace",
    "new",
    "noexcept",
    "not",
    "not_eq",
    "nullptr",
    "operator",
    "or",
    "or_eq",
    "private",
    "protected",
    "public",
    "register",
    "reinterpret_cast",
    "requires",
    "return",
    "short",
    "signed",
    "sizeof",
    "static",
    "static_assert",
    "static_cast",
    "struct",
    "switch",
    "template",
    "this",
    "thread_local",
    "throw",
    "true",
    "try",
    "typedef",
    "typeid",
    "typename",
    "union",
    "unsigned",
    "using",
    "virtual",
    "void",
    "volatile",
    "wchar_t",
    "while",
    "xor",
    "xor_eq",
];

/// Checks that `name` can be a C++ identifier in the header:
///
/// 1. ASCII letters, digits and `_`, not starting with a digit, not empty;
/// 2. not reserved to the implementation (`__` anywhere, or `_` then an
///    upper-case letter at the start);
/// 3. not a C++ keyword, nor a name the header declares itself.
pub fn check_identifier(name: &str) -> Result<(), LayoutError> {
    let invalid = |reason| {
        Err(LayoutError::InvalidName {
            name: name.to_owned(),
            reason,
        })
    };
    let mut chars = name.chars();
    match chars.next() {
        None => return invalid("the name is empty"),
        Some(c) if !(c.is_ascii_alphabetic() || c == '_') => {
            return invalid("a C++ identifier starts with a letter or `_`")
        }
        _ => {}
    }
    if !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return invalid("a C++ identifier holds only ASCII letters, digits and `_`");
    }
    let b = name.as_bytes();
    if name.contains("__") || (b[0] == b'_' && b.get(1).is_some_and(u8::is_ascii_uppercase)) {
        return invalid("the name is reserved to the C++ implementation");
    }
    if CPP_KEYWORDS.contains(&name) {
        return invalid("the name is a C++ keyword");
    }
    if RESERVED.contains(&name) {
        return invalid("the header declares this name itself");
    }
    Ok(())
}

/// Checks everything [`render_header`] needs of its inputs:
///
/// 1. the plan's offset model is valid;
/// 2. tensor names and const names are identifiers
///    ([`check_identifier`]), all distinct;
/// 3. every tensor has rank >= 1 and non-empty, contiguous chunks covering
///    its layer axis, and its layer count fits the header's `unsigned int`.
pub fn validate_header_inputs(plan: &ModelPlan, consts: &[(&str, u64)]) -> Result<(), LayoutError> {
    plan.offset_model.validate()?;
    let mut names = BTreeSet::new();
    let tensor_names = plan.tensors.iter().map(|t| t.spec.name.as_str());
    for name in tensor_names.chain(consts.iter().map(|&(n, _)| n)) {
        check_identifier(name)?;
        if !names.insert(name) {
            return Err(LayoutError::InvalidName {
                name: name.to_owned(),
                reason: "the name is declared twice in the header",
            });
        }
    }
    for t in &plan.tensors {
        check_tensor(t)?;
    }
    Ok(())
}

/// Condition 3 of [`validate_header_inputs`] for one tensor.
fn check_tensor(t: &TensorPlan) -> Result<(), LayoutError> {
    let name = &t.spec.name;
    let layers = t.spec.layers().ok_or_else(|| LayoutError::NoStackedAxis {
        tensor: name.clone(),
    })?;
    let narrow = |what, value: u64| {
        u32::try_from(value).map_err(|_| LayoutError::HeaderRange {
            tensor: name.clone(),
            what,
            value,
        })
    };
    narrow("the layer count", layers)?;
    narrow("the rank", t.spec.layout.rank() as u64)?;
    let mut next = 0;
    for c in &t.chunks {
        if c.start != next || c.end <= c.start {
            return Err(LayoutError::LayerOutOfRange {
                tensor: name.clone(),
                layer: c.start,
                layers,
            });
        }
        next = c.end;
    }
    if next != layers {
        return Err(LayoutError::LayerOutOfRange {
            tensor: name.clone(),
            layer: next,
            layers,
        });
    }
    // The whole tensor's span must be stateable too (the header gives kBytes).
    t.spec.byte_span()?;
    Ok(())
}

/// [`render_header`], or the reason its inputs cannot make a valid header.
pub fn try_render_header(plan: &ModelPlan, consts: &[(&str, u64)]) -> Result<String, LayoutError> {
    validate_header_inputs(plan, consts)?;
    let mut out = String::new();
    render_prelude(&mut out, plan)?;
    if !consts.is_empty() {
        out.push_str("// Model constants.\n");
        for (name, value) in consts {
            out.push_str(&format!(
                "constexpr unsigned long long {name} = {value}ull;\n"
            ));
        }
        out.push('\n');
    }
    for t in &plan.tensors {
        render_tensor(&mut out, t)?;
    }
    out.push_str("}  // namespace qmk_plan\n");
    Ok(out)
}

/// Renders `plan` (and the extra constants `consts`, in order) as the C++
/// header the kernel is compiled with. Deterministic byte for byte.
///
/// Plans from [`plan_model`](crate::plan_model) always render; inputs that
/// [`validate_header_inputs`] rejects (a bad const name, a hand-edited plan)
/// render as a header whose `#error` states the reason, so the kernel
/// compile fails with it. Use [`try_render_header`] to get the error itself.
///
/// ```
/// use qmk_layout::{plan_model, render_header, DType, TensorSpec, KERNEL_OFFSET_MODEL};
/// let gate = TensorSpec::row_major("gate_proj", &[48, 13824, 5120], DType::BF16)?;
/// let plan = plan_model(&[gate], &KERNEL_OFFSET_MODEL)?;
/// let h = render_header(&plan, &[("kNumLayers", 48)]);
/// assert!(h.contains("constexpr unsigned int kOffsetBits = 32u;"));
/// assert!(h.contains("constexpr unsigned long long kNumLayers = 48ull;"));
/// assert!(h.contains("constexpr unsigned int kChunkStart[] = {0u, 24u, 48u};"));
/// assert_eq!(h, render_header(&plan, &[("kNumLayers", 48)]));
/// # Ok::<(), qmk_layout::LayoutError>(())
/// ```
#[must_use]
pub fn render_header(plan: &ModelPlan, consts: &[(&str, u64)]) -> String {
    try_render_header(plan, consts).unwrap_or_else(|e| {
        // Quotes and line breaks would end the #error message early.
        let reason: String = e
            .to_string()
            .chars()
            .map(|c| {
                if c == '"' || c == '\\' || c.is_control() {
                    '\''
                } else {
                    c
                }
            })
            .collect();
        format!("#pragma once\n#error \"qmk_plan: cannot render the split plan: {reason}\"\n")
    })
}

/// The banner, the QMK_PLAN_HD macro, the offset model and the helpers.
fn render_prelude(out: &mut String, plan: &ModelPlan) -> Result<(), LayoutError> {
    let m = &plan.offset_model;
    out.push_str(
        "// The split plan the megakernel is compiled with. Generated by qmk-layout; do not edit.\n\
         // Builtin types only: NVRTC has no <cstdint>.\n\
         #pragma once\n\
         \n\
         #ifndef QMK_PLAN_HD\n\
         #if defined(__CUDACC__) || defined(__CUDACC_RTC__)\n\
         #define QMK_PLAN_HD __host__ __device__\n\
         #else\n\
         #define QMK_PLAN_HD\n\
         #endif\n\
         #endif\n\
         \n\
         namespace qmk_plan {\n\
         \n",
    );
    out.push_str(&format!(
        "// Offset model: {m}.\n\
         // The kernel indexes each chunk from its own base pointer with kOffsetBits-bit\n\
         // unsigned offsets in units of kOffsetUnitBytes bytes (0 = one element of the\n\
         // tensor's dtype, kElemBytes).\n\
         constexpr unsigned int kOffsetBits = {}u;\n\
         constexpr unsigned int kOffsetUnitBytes = {}u;\n\
         constexpr unsigned long long kMaxOffset = {}ull;  // 2^kOffsetBits - 1\n",
        m.bits,
        m.unit_bytes(),
        m.max_offset()?,
    ));
    out.push_str(
        "static_assert(kOffsetBits >= 1u && kOffsetBits <= 64u, \"kOffsetBits out of range\");\n\
         static_assert(kMaxOffset == (~0ull >> (64u - kOffsetBits)), \"kMaxOffset is not 2^kOffsetBits - 1\");\n\
         \n\
         // Every function is QMK_PLAN_HD: NVRTC rejects host-only functions.\n\
         namespace detail {\n\
         // Byte span of layers [start, end) of a stacked layout, from the first of them:\n\
         // (1 + (end - start - 1) * stride[0] + sum_{i>0} (shape[i] - 1) * stride[i]) * elem_bytes.\n\
         template <unsigned int R>\n\
         QMK_PLAN_HD constexpr unsigned long long span_bytes(const unsigned long long (&shape)[R],\n\
         \x20                                                   const unsigned long long (&stride)[R],\n\
         \x20                                                   unsigned long long elem_bytes,\n\
         \x20                                                   unsigned long long start, unsigned long long end) {\n\
         \x20 unsigned long long last = (end - start - 1ull) * stride[0];\n\
         \x20 for (unsigned int i = 1u; i < R; ++i) last += (shape[i] - 1ull) * stride[i];\n\
         \x20 return (last + 1ull) * elem_bytes;\n\
         }\n\
         // Largest offset, in the model's unit, inside `bytes` bytes of elem_bytes-byte elements.\n\
         QMK_PLAN_HD constexpr unsigned long long max_offset(unsigned long long bytes, unsigned long long elem_bytes) {\n\
         \x20 return kOffsetUnitBytes == 0u\n\
         \x20            ? bytes / elem_bytes - 1ull\n\
         \x20            : bytes / kOffsetUnitBytes + (bytes % kOffsetUnitBytes != 0ull ? 1ull : 0ull) - 1ull;\n\
         }\n\
         }  // namespace detail\n\
         \n",
    );
    Ok(())
}

/// `{a, b, c}` with each value followed by `suffix`.
fn list<T: std::fmt::Display>(values: impl IntoIterator<Item = T>, suffix: &str) -> String {
    let items: Vec<String> = values.into_iter().map(|v| format!("{v}{suffix}")).collect();
    format!("{{{}}}", items.join(", "))
}

/// `QMK_PLAN_HD constexpr RET NAME(unsigned int PARAM)` returning
/// `values[PARAM]` (the last value for any larger PARAM) through a chain of
/// literal comparisons.
fn lookup(ret: &str, name: &str, param: &str, values: &[u64], suffix: &str) -> String {
    let Some((last, init)) = values.split_last() else {
        return String::new();
    };
    if init.is_empty() {
        return format!(
            "QMK_PLAN_HD constexpr {ret} {name}(unsigned int /*{param}*/) {{ return {last}{suffix}; }}\n"
        );
    }
    let mut chain = String::new();
    for (i, v) in init.iter().enumerate() {
        chain.push_str(&format!("{param} < {}u ? {v}{suffix} : ", i + 1));
    }
    format!(
        "QMK_PLAN_HD constexpr {ret} {name}(unsigned int {param}) {{ return {chain}{last}{suffix}; }}\n"
    )
}

/// One tensor's namespace.
fn render_tensor(out: &mut String, t: &TensorPlan) -> Result<(), LayoutError> {
    let name = &t.spec.name;
    let layout = &t.spec.layout;
    let dtype = t.spec.dtype;
    let n = t.chunks.len();
    let layers = t.spec.layers().unwrap_or(0);
    let bytes = t.spec.byte_span()?;
    let offsets = (0..n)
        .map(|c| t.chunk_byte_offset(c).map(|b| b.0))
        .collect::<Result<Vec<u64>, _>>()?;

    out.push_str(&format!(
        "// {name}: {layout} {dtype}, {} bytes ({}), {n} chunk{}.\n",
        bytes.0,
        bytes.gb(),
        if n == 1 { "" } else { "s" },
    ));
    out.push_str(&format!("namespace {name} {{\n"));
    out.push_str(&format!(
        "constexpr unsigned int kRank = {}u;\n",
        layout.rank()
    ));
    out.push_str(&format!(
        "constexpr unsigned long long kShape[] = {};\n",
        list(layout.shape(), "ull")
    ));
    out.push_str(&format!(
        "constexpr unsigned long long kStride[] = {};  // elements\n",
        list(layout.stride(), "ull")
    ));
    out.push_str(&format!(
        "constexpr unsigned long long kElemBytes = {}ull;  // {dtype}\n",
        dtype.size_bytes()
    ));
    out.push_str(&format!(
        "constexpr unsigned long long kBytes = {}ull;  // byte span of the stacked tensor\n",
        bytes.0
    ));
    out.push_str(&format!("constexpr unsigned int kNumChunks = {n}u;\n"));
    out.push_str("// Chunk c holds layers [kChunkStart[c], kChunkStart[c + 1]).\n");
    out.push_str(&format!(
        "constexpr unsigned int kChunkStart[] = {};\n",
        list(t.chunks.iter().map(|c| c.start).chain([layers]), "u")
    ));
    out.push_str("// Byte offset of chunk c in the stacked tensor (host side, 64-bit).\n");
    out.push_str(&format!(
        "constexpr unsigned long long kChunkOffsetBytes[] = {};\n",
        list(&offsets, "ull")
    ));
    out.push_str("// Byte span of chunk c from its own base pointer.\n");
    out.push_str(&format!(
        "constexpr unsigned long long kChunkBytes[] = {};\n",
        list(t.chunks.iter().map(|c| c.byte_span.0), "ull")
    ));
    out.push_str(&format!(
        "static_assert(sizeof(kShape) / sizeof(kShape[0]) == kRank && sizeof(kStride) / sizeof(kStride[0]) == kRank, \"{name}: rank\");\n\
         static_assert(kChunkStart[0] == 0u && kChunkStart[kNumChunks] == kShape[0], \"{name}: chunks must cover the layer axis\");\n\
         static_assert(detail::span_bytes(kShape, kStride, kElemBytes, 0ull, kShape[0]) == kBytes, \"{name}: kBytes disagrees with the layout\");\n"
    ));
    for c in 0..n {
        out.push_str(&format!(
            "static_assert(kChunkStart[{c}] < kChunkStart[{next}], \"{name} chunk {c}: empty\");\n\
             static_assert(kChunkOffsetBytes[{c}] == kChunkStart[{c}] * kStride[0] * kElemBytes, \"{name} chunk {c}: offset disagrees with the layout\");\n\
             static_assert(detail::span_bytes(kShape, kStride, kElemBytes, kChunkStart[{c}], kChunkStart[{next}]) == kChunkBytes[{c}], \"{name} chunk {c}: span disagrees with the layout\");\n\
             static_assert(detail::max_offset(kChunkBytes[{c}], kElemBytes) <= kMaxOffset, \"{name} chunk {c}: offsets overflow kOffsetBits\");\n",
            next = c + 1,
        ));
    }

    // Device-callable lookups, written as literal ternary chains: device
    // code may not index the namespace-scope arrays with a run-time value.
    let starts: Vec<u64> = t.chunks.iter().map(|c| c.start).chain([layers]).collect();
    let spans: Vec<u64> = t.chunks.iter().map(|c| c.byte_span.0).collect();
    out.push_str(
        "// Device code cannot read the arrays above (nvcc: \"undefined in device code\");\n\
         // these twins can, with run-time arguments. chunk_of: the chunk holding `layer`\n\
         // (< kShape[0]); local_layer: `layer`'s index inside that chunk.\n",
    );
    out.push_str(&lookup(
        "unsigned long long",
        "shape",
        "mode",
        layout.shape(),
        "ull",
    ));
    out.push_str(&lookup(
        "unsigned long long",
        "stride",
        "mode",
        layout.stride(),
        "ull",
    ));
    out.push_str(&lookup(
        "unsigned int",
        "chunk_start",
        "chunk",
        &starts,
        "u",
    ));
    out.push_str(&lookup(
        "unsigned long long",
        "chunk_offset_bytes",
        "chunk",
        &offsets,
        "ull",
    ));
    out.push_str(&lookup(
        "unsigned long long",
        "chunk_bytes",
        "chunk",
        &spans,
        "ull",
    ));
    if n == 1 {
        out.push_str(
            "QMK_PLAN_HD constexpr unsigned int chunk_of(unsigned int /*layer*/) { return 0u; }\n",
        );
    } else {
        let mut chain = String::new();
        for (c, chunk) in t.chunks.iter().enumerate().take(n - 1) {
            chain.push_str(&format!("layer < {}u ? {c}u : ", chunk.end));
        }
        out.push_str(&format!(
            "QMK_PLAN_HD constexpr unsigned int chunk_of(unsigned int layer) {{ return {chain}{}u; }}\n",
            n - 1
        ));
    }
    out.push_str("QMK_PLAN_HD constexpr unsigned int local_layer(unsigned int layer) { return layer - chunk_start(chunk_of(layer)); }\n");
    let modes: Vec<String> = (0..layout.rank())
        .map(|i| format!("shape({i}u) == kShape[{i}] && stride({i}u) == kStride[{i}]"))
        .collect();
    out.push_str(&format!(
        "static_assert({}, \"{name}: shape()/stride() disagree with kShape/kStride\");\n",
        modes.join(" && ")
    ));
    for (c, chunk) in t.chunks.iter().enumerate() {
        out.push_str(&format!(
            "static_assert(chunk_of({s}u) == {c}u && chunk_of({l}u) == {c}u && chunk_start({c}u) == kChunkStart[{c}] && \
             chunk_offset_bytes({c}u) == kChunkOffsetBytes[{c}] && chunk_bytes({c}u) == kChunkBytes[{c}], \
             \"{name} chunk {c}: lookups disagree with the arrays\");\n",
            s = chunk.start,
            l = chunk.end - 1,
        ));
    }
    out.push_str(&format!(
        "static_assert(chunk_start(kNumChunks) == kShape[0], \"{name}: chunk_start(kNumChunks) is not the layer count\");\n"
    ));
    out.push_str(&format!("}}  // namespace {name}\n\n"));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{plan_model, DType, TensorSpec, KERNEL_OFFSET_MODEL};

    fn small_plan() -> ModelPlan {
        let s = TensorSpec::row_major("w", &[4, 3], DType::BF16).unwrap();
        plan_model(&[s], &KERNEL_OFFSET_MODEL).unwrap()
    }

    #[test]
    fn identifiers() {
        for ok in ["q_proj", "gate_proj", "_x", "kHidden", "a1"] {
            assert_eq!(check_identifier(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "1a",
            "a.b",
            "a-b",
            "a b",
            "__a",
            "a__b",
            "_A",
            "int",
            "detail",
            "QMK_PLAN_HD",
            "é",
        ] {
            assert!(check_identifier(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_consts_render_an_error_directive() {
        let plan = small_plan();
        let e = try_render_header(&plan, &[("w", 1)]).unwrap_err();
        assert!(e.to_string().contains("declared twice"), "{e}");
        let h = render_header(&plan, &[("not an \"ident\"", 1)]);
        assert!(
            h.starts_with("#pragma once\n#error \"qmk_plan: cannot render"),
            "{h}"
        );
        assert_eq!(h.matches('"').count(), 2, "{h}");
    }

    #[test]
    fn hand_edited_plans_are_rejected() {
        let mut plan = small_plan();
        plan.tensors[0].chunks[0].end = 3;
        assert!(try_render_header(&plan, &[]).is_err());
        let mut plan = small_plan();
        plan.offset_model.bits = 0;
        assert!(try_render_header(&plan, &[]).is_err());
    }
}
