//! Qwen3.5's hybrid decoder (Gated DeltaNet + gated attention) through the paged engine, on
//! the tiny Qwen3.5 checkpoint: the paged engine equals the dense
//! reference; the prefix cache (K/V blocks + recurrent-state snapshots) changes no greedy
//! token and serves the shared prefixes; preemption and a pool with 8 state slots for 64
//! dialogues give the sequential outputs and free every slot.

mod common;

use candle_core::{DType, Device};
use common::*;
use merg::chat::{ContentPart, Message};
use merg::checkpoint::Checkpoint;
use merg::engine::{ChatRequest, Completion, Engine, EngineConfig, EngineResult, KvMemory, SchedulerConfig};
use merg::generate::SamplingParams;
use merg::vision::Media;

/// The tiny Qwen3.5 checkpoint (HF-verified in tests/parity.rs), loaded once for the whole
/// test binary.
fn checkpoint() -> Checkpoint {
    static MODEL: std::sync::OnceLock<Checkpoint> = std::sync::OnceLock::new();
    let ck = MODEL.get_or_init(|| {
        let files = merg::hub::resolve(tiny_dir("qwen3_5").to_str().unwrap(), None).unwrap();
        Checkpoint::load(files, &Device::Cpu, Some(DType::F32)).unwrap()
    });
    Checkpoint { model: ck.model.clone(), processor: ck.processor.clone(), files: None, gguf: None, quant_stats: None, tokenizer_json: None }
}

fn engine(blocks: usize, prefix_caching: bool, scheduler: SchedulerConfig) -> Engine {
    let cfg = EngineConfig { kv_memory: KvMemory::Blocks(blocks), prefix_caching, scheduler, ..Default::default() };
    Engine::new(checkpoint(), cfg).unwrap()
}

fn image(name: &str) -> image::RgbImage {
    merg::vision::load_image(&fixtures().join("media").join(name)).unwrap()
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_new_tokens: n, stop_token_ids: vec![u32::MAX], ..Default::default() }
}

const AGENTS: [&str; 5] = ["Describe the cues.", "Name the emotion.", "Plan the reply.", "Write the reply.", "Audit the reply."];
const LINES: [&str; 4] = ["I just lost my job today.", "We finally got the apartment!", "Okay. Fine. Whatever.", "Why would you say that?"];
const IMAGES: [&str; 3] = ["img_a.png", "img_b.png", "img_small.png"];

/// Dialogue `d`'s call for agent `a`: a shared prefix (dialogue lines and keyframes) and an
/// agent-specific suffix, like the pipeline's prompts. Dialogues 0 and 3 share their text but
/// not their image.
fn call(d: usize, a: usize, new_tokens: usize) -> ChatRequest {
    let text = format!("Dialogue {}:\nA: {}\nB: {}\n", d % 3, LINES[d % 4], LINES[(d + 1) % 4]);
    let content = vec![ContentPart::Text(text), ContentPart::Image, ContentPart::Text(AGENTS[a % 5].to_string())];
    let media = vec![Media::Image(image(IMAGES[d % 3]))];
    ChatRequest { messages: vec![Message::new("user", content)], media, sampling: greedy(new_tokens), schema: None, constraint: None }
}

fn workload(n: usize) -> Vec<ChatRequest> {
    (0..n).map(|i| call(i / 5, i % 5, 5)).collect()
}

fn tokens(r: &[EngineResult<Completion>]) -> Vec<Vec<u32>> {
    r.iter().map(|c| c.as_ref().unwrap().tokens.clone()).collect()
}

fn sched(max_num_seqs: usize, max_step_tokens: usize) -> SchedulerConfig {
    SchedulerConfig { max_num_seqs, max_step_tokens }
}

#[test]
fn hybrid_paged_engine_equals_the_dense_reference_with_any_chunks() {
    let ck = checkpoint();
    assert!(ck.model.spec().has_recurrent_layers());
    let reqs = workload(10);
    let mut want = vec![];
    for r in &reqs {
        let (ids, vision) = merg::generate::reference_inputs(&ck.processor, &r.messages, &r.media, &Device::Cpu).unwrap();
        want.push(merg::generate::generate(&*ck.model, &ids, &vision, &r.sampling, None).unwrap().tokens);
    }
    for (seqs, step) in [(4, 2048), (3, 7), (2, 65)] {
        let mut eng = engine(256, false, sched(seqs, step));
        assert_eq!(tokens(&eng.run_all(workload(10))), want, "{seqs} seqs, {step}-token steps");
    }
}

/// Eight dialogues at once, each running its five agents one after another (as the pipeline
/// does): every agent after the first finds its dialogue's prefix — K/V blocks and the
/// recurrent state after the keyframe — in the cache.
#[test]
fn hybrid_prefix_cache_on_equals_off_and_serves_the_shared_prefix() {
    let mut on = engine(512, true, sched(8, 2048));
    let mut off = engine(512, false, sched(8, 2048));
    for agent in 0..5 {
        let round = |_: ()| (0..8).map(|d| call(d, agent, 5)).collect::<Vec<_>>();
        assert_eq!(tokens(&on.run_all(round(()))), tokens(&off.run_all(round(()))), "agent {agent}");
    }
    // 100 mixed requests at once: the same text with different images, the same image with
    // different texts, repeats, all racing for the cache.
    let mixed = |_: ()| (0..100).map(|i| {
        let mut r = call(i % 7, (i / 7) % 5, 4);
        r.media = vec![Media::Image(image(IMAGES[(i / 3) % 3]))];
        r
    }).collect::<Vec<_>>();
    assert_eq!(tokens(&on.run_all(mixed(()))), tokens(&off.run_all(mixed(()))), "100 mixed requests");
    let s = on.stats();
    println!("hybrid prefix cache: {:?} snapshots {:?}", s.prefix, s.snapshots);
    let snaps = s.snapshots.unwrap();
    assert!(snaps.restored > 0 && snaps.stored > 0);
    // Eight dialogues × five agents: every agent after the first resumes after the keyframe.
    assert!(s.prefix.cached_tokens * 2 > s.prefix.prompt_tokens, "{:?}", s.prefix);
    assert_eq!(off.stats().prefix.cached_tokens, 0);
}

#[test]
fn sixty_four_dialogues_on_eight_state_slots() {
    let per = merg::engine::engine::state_bytes_per_seq(checkpoint().model.spec());
    let cfg = EngineConfig {
        kv_memory: KvMemory::Blocks(40),
        state_memory: Some(8 * per),
        scheduler: sched(64, 2048),
        ..Default::default()
    };
    let mut eng = Engine::new(checkpoint(), cfg).unwrap();
    assert_eq!(eng.stats().state_slots, 8);
    assert!(eng.state_summary().unwrap().contains("8 slots"), "{:?}", eng.state_summary());
    let reqs: Vec<ChatRequest> = (0..64).map(|i| call(i * 7 % 13, i % 5, 6)).collect();
    let got = eng.run_all(reqs);
    assert!(got.iter().all(|r| r.is_ok()));
    let stats = eng.stats();
    println!("64 on 8 slots: {stats:?}");
    assert_eq!(stats.running, 0);
    assert_eq!(eng.num_free_blocks(), 40, "every block back in the pool");
    assert!(stats.preemptions > 0, "40 blocks for 8 running ~100-token prompts force preemption");
    let mut solo = engine(256, false, sched(1, 2048));
    let want: Vec<Vec<u32>> = (0..64).map(|i| tokens(&solo.run_all(vec![call(i * 7 % 13, i % 5, 6)]))[0].clone()).collect();
    assert_eq!(tokens(&got), want);
}

/// Qwen3.5: the recurrent layers add no read-back (their state stays a tensor on the device
/// path): at most one per step, one in every step that samples.
#[test]
fn hybrid_one_read_back_per_step() {
    let mut e = engine(512, true, sched(8, 64));
    let out = e.run_all(workload(8));
    assert!(out.iter().all(|c| c.is_ok()));
    let stats = e.stats();
    println!("{} steps, {} read-backs", stats.steps, stats.readbacks);
    assert!(stats.readbacks <= stats.steps && stats.readbacks >= 5, "{} read-backs in {} steps", stats.readbacks, stats.steps);
    // Under MERG_CPU_KERNELS=generic no CPU kernel or host fast path ran in this process (the
    // delta rule included); otherwise they did.
    let runs = merg::cpu::kernel_runs();
    match merg::cpu::generic() {
        true => assert_eq!(runs, 0, "{runs} CPU kernel runs under MERG_CPU_KERNELS=generic"),
        false => assert!(runs > 0, "the CPU path ran no CPU kernel"),
    }
}
