//! The twin's step-time model and its profile files: the formula, the published figures the GPU
//! profiles must reproduce, and errors that name the file, line and field.
use session_gate::Error;
use session_gate::sim::{CostModel, StepWork};

fn work(entries: &[(u32, u32, u32, u32)]) -> StepWork {
    let mut w = StepWork::default();
    for &(n, before, num_tokens, num_output) in entries {
        w.add(n, before, num_tokens, num_output);
    }
    w
}

const GOOD: &str = r#"
name = "test"
description = "a test profile"

[replica]
num_blocks = 100
block_size = 16
max_num_seqs = 8
max_num_batched_tokens = 512
kv_bytes_per_token = 1024
source = "made up"

[cost]
step_sec = { value = 0.001, source = "a" }
per_seq_sec = { value = 0.0001, source = "b" }
per_token_sec = { value = 0.00001, source = "c" }
weights_sec = { value = 0.002, source = "d" }
prefill_attn_sec = { value = 1e-9, source = "e" }
decode_ctx_sec = { value = 1e-8, source = "f" }
"#;

#[test]
fn step_time_follows_the_documented_form() {
    let m = CostModel::from_toml("good.toml", GOOD).unwrap();
    assert_eq!(
        m.step_time(&StepWork::default()),
        0.0,
        "an empty step costs nothing"
    );
    // One prefill chunk of 100 tokens after 50 cached, and two decodes at contexts 300 and 500.
    let w = work(&[(100, 50, 150, 0), (1, 299, 300, 3), (1, 499, 500, 9)]);
    assert_eq!((w.num_prefills, w.num_decodes, w.total_tokens), (1, 2, 102));
    assert_eq!(w.prefill_attn, 100.0 * (50.0 + 50.0));
    assert_eq!(w.decode_ctx, 800);
    let dense = (0.00001f64 * 102.0).max(0.002);
    let want = 0.001 + 0.0001 * 3.0 + dense + 1e-9 * 10_000.0 + 1e-8 * 800.0;
    assert!((m.step_time(&w) - want).abs() < 1e-12);
    // Many tokens: compute-bound, the weight-read floor no longer applies.
    let big = work(&[(512, 0, 512, 0)]);
    let want = 0.001 + 0.0001 + 0.00001 * 512.0 + 1e-9 * 512.0 * 256.0;
    assert!((m.step_time(&big) - want).abs() < 1e-12);
    assert_eq!(m.shape.num_blocks, 100);
    assert_eq!(m.coefficients()[4].name, "prefill_attn_sec");
    assert_eq!(m.coefficients()[4].source, "e");
}

#[test]
fn a_recomputed_single_token_is_a_prefill_not_a_decode() {
    // A preempted request re-admitted with one token left behaves as prefill (no outputs yet).
    let w = work(&[(1, 0, 1, 0)]);
    assert_eq!((w.num_prefills, w.num_decodes), (1, 0));
}

#[test]
fn gpu_profiles_reproduce_the_published_and_design_figures() {
    // Published figures the profile was fitted to: H200 Qwen2.5-7B prefill 8K ≈ 0.22 s,
    // 32K ≈ 1.2 s (one request, chunks of 8192).
    let m = CostModel::profile("h200-qwen2.5-7b").unwrap();
    let prefill = |len: u32| -> f64 {
        let mut t = 0.0;
        let mut done = 0;
        while done < len {
            let c = (len - done).min(8192);
            t += m.step_time(&work(&[(c, done, len, 0)]));
            done += c;
        }
        t
    };
    let p8 = prefill(8192);
    let p32 = prefill(32768);
    assert!((0.20..0.26).contains(&p8), "8K prefill {p8}");
    assert!((1.05..1.35).contains(&p32), "32K prefill {p32}");
    // 32B: 32K ≈ 5 s.
    let m32 = CostModel::profile("h200-qwen2.5-32b").unwrap();
    let mut t = 0.0;
    for k in 0..4 {
        t += m32.step_time(&work(&[(8192, k * 8192, 32768, 0)]));
    }
    assert!((4.3..5.8).contains(&t), "32B 32K prefill {t}");
    // H100 Llama-3.1-8B against the measured Qwen3-8B H100 figures (a model of the same
    // size): decode step at batch 1 ≈ 6.9 ms and prefill of 8,192 tokens ≈ 254 ms, within 20%.
    let h = CostModel::profile("h100-llama3.1-8b").unwrap();
    let d1 = h.step_time(&work(&[(1, 1023, 1024, 1)]));
    assert!((0.0055..0.0083).contains(&d1), "decode batch 1 {d1}");
    let p = h.step_time(&work(&[(8192, 0, 8192, 0)]));
    assert!((0.203..0.305).contains(&p), "prefill 8K {p}");
}

#[test]
fn profiles_name_their_shape() {
    let m = CostModel::profile("h200-qwen2.5-7b").unwrap();
    assert_eq!(m.shape.num_blocks, 126_000);
    assert_eq!(m.shape.block_size, 16);
    assert_eq!(m.shape.kv_bytes_per_token, 57_344);
    let tiny = CostModel::profile("cpu-tiny").unwrap();
    assert_eq!((tiny.shape.num_blocks, tiny.shape.block_size), (1024, 32));
    assert_eq!(
        (tiny.shape.max_num_seqs, tiny.shape.max_num_batched_tokens),
        (16, 8192)
    );
    for m in CostModel::profile_names()
        .iter()
        .map(|n| CostModel::profile(n).unwrap())
    {
        assert!(m.coefficients().iter().all(|c| !c.source.is_empty()));
    }
    let err = CostModel::profile("a100").unwrap_err().to_string();
    assert!(
        err.contains("a100") && err.contains("h200-qwen2.5-7b"),
        "{err}"
    );
}

fn profile_error(text: &str) -> (String, usize, String) {
    match CostModel::from_toml("my.toml", text).unwrap_err() {
        Error::InvalidProfile {
            file,
            line,
            field,
            why,
        } => {
            assert!(!why.is_empty());
            (file, line, field)
        }
        other => panic!("expected InvalidProfile, got {other:?}"),
    }
}

fn line_of(text: &str, needle: &str) -> usize {
    text.lines().position(|l| l.contains(needle)).unwrap() + 1
}

#[test]
fn a_negative_coefficient_names_file_line_and_field() {
    let text = GOOD.replace("value = 1e-8", "value = -1e-8");
    let (file, line, field) = profile_error(&text);
    assert_eq!(file, "my.toml");
    assert_eq!(field, "cost.decode_ctx_sec");
    assert_eq!(line, line_of(&text, "decode_ctx_sec"));
}

#[test]
fn a_wrong_type_names_the_line_and_field() {
    let text = GOOD.replace("block_size = 16", "block_size = \"sixteen\"");
    let (_, line, field) = profile_error(&text);
    assert_eq!(line, line_of(&text, "block_size"));
    assert_eq!(field, "block_size");
}

#[test]
fn a_missing_source_or_field_is_named() {
    let text = GOOD.replace("{ value = 0.002, source = \"d\" }", "{ value = 0.002 }");
    let (_, line, field) = profile_error(&text);
    assert_eq!(field, "source");
    assert_eq!(line, line_of(&text, "weights_sec"));
    let text = GOOD.replace("max_num_seqs = 8\n", "");
    let (_, _, field) = profile_error(&text);
    assert_eq!(field, "max_num_seqs");
}

#[test]
fn an_unknown_field_or_zero_block_size_is_refused() {
    let text = GOOD.replace(
        "[cost]\n",
        "[cost]\nstep_ms = { value = 1.0, source = \"x\" }\n",
    );
    let (_, line, field) = profile_error(&text);
    assert_eq!(field, "step_ms");
    assert_eq!(line, line_of(&text, "step_ms"));
    let text = GOOD.replace("block_size = 16", "block_size = 0");
    let (_, line, field) = profile_error(&text);
    assert_eq!(field, "replica.block_size");
    assert_eq!(line, line_of(&text, "block_size"));
    let (_, line, _) = profile_error("name = \"x\"\nnot toml at all");
    assert_eq!(line, 2);
}
