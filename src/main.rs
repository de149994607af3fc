//! `merg` command line: parses the command and dispatches to `cli/`. Every failure prints one
//! clear error chain and exits non-zero.

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

mod cli;

#[derive(Parser)]
#[command(name = "merg", version, about = "Multimodal empathetic response generation on Qwen vision-language models")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Answer one chat prompt (text plus optional images / a video).
    Generate(Box<cli::generate::GenerateArgs>),
    /// Print what a checkpoint is (family, sizes, files) without running it.
    Info(cli::info::InfoArgs),
    /// Memory plan from a config: weights, K/V per token, state per sequence, what fits.
    Plan(cli::plan::PlanArgs),
    /// Decode throughput on a checkpoint or on dummy weights of a config (fixed token budgets).
    Bench(cli::bench::BenchArgs),
    /// The five-agent workload on the paged engine, prefix cache on vs off, in one run.
    BenchAgents(cli::bench::BenchAgentsArgs),
    /// Answer a dialogue with the five-agent MERG pipeline; prints the reply, writes a trace.
    Respond(cli::respond::RespondArgs),
    /// Run the pipeline over a dataset split (resumable, shardable) and summarise the metrics.
    Eval(Box<cli::eval::EvalArgs>),
    /// Build the exemplar memory for SGRG from a held-out split (MELD dev, IEMOCAP Session 2).
    Memory(cli::eval::MemoryArgs),
    /// Serve the model over HTTP: OpenAI and Ollama APIs plus /v1/merg/respond.
    #[cfg(feature = "serve")]
    Serve(Box<cli::serve::ServeArgs>),
    /// Tables, figures and human-evaluation sheets from eval run folders.
    Report(cli::report::ReportArgs),
    /// Draw a saved benchmark JSON as a figure (.svg or .png): `serve-load` (bench_serve.py's
    /// rows, as scripts/bench-serve.sh saves them) or `bench-agents` (its printed report).
    Plot(cli::report::PlotArgs),
}

fn main() -> ExitCode {
    // Before any thread: the heap's freed buffers are shared by every thread (memory.rs says why).
    merg::memory::one_malloc_arena();
    // Before any thread too: candle's products read the thread count from the environment.
    merg::cpu::name_thread_count();
    // Every command runs its model steps on this thread.
    merg::cpu::adopt_thread();
    // Negative numbers reach the value's own rule ("--top-p -1: must be in (0, 1]") instead
    // of being taken for an unknown flag.
    let mut cmd = Cli::command().mut_subcommands(|s| s.allow_negative_numbers(true));
    let matches = cmd.clone().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.format(&mut cmd).exit());
    // `--quiet` belongs to the model group every model-loading command flattens.
    let quiet = matches.subcommand().and_then(|(_, m)| m.try_get_one::<bool>("quiet").ok().flatten().copied()).unwrap_or(false);
    cli::progress::install(quiet);
    cli::words::remember(cmd, matches);
    // A server logs one line per request by default; other commands only what RUST_LOG asks.
    #[cfg(feature = "serve")]
    let default = if matches!(cli.cmd, Cmd::Serve(_)) { "merg=info" } else { "error" };
    #[cfg(not(feature = "serve"))]
    let default = "error";
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    if let Ok(forced) = std::env::var("MERG_CPU_KERNELS") {
        // The library's warning is a tracing event, hidden at the default filter.
        if let (_, Some(w)) = merg::cpu::choose_level(Some(&forced), merg::cpu::Level::detected()) {
            eprintln!("warning: {w}");
        }
        eprintln!("cpu kernels: {} (MERG_CPU_KERNELS; this machine has {})", merg::cpu::level().name(), merg::cpu::Level::detected().name());
    }
    let result = match cli.cmd {
        Cmd::Generate(a) => cli::generate::cmd_generate(*a),
        Cmd::Info(a) => cli::info::cmd_info(a),
        Cmd::Plan(a) => cli::plan::cmd_plan(a),
        Cmd::Bench(a) => cli::bench::cmd_bench(a),
        Cmd::BenchAgents(a) => cli::bench::cmd_bench_agents(a),
        Cmd::Respond(a) => cli::respond::cmd_respond(a),
        Cmd::Eval(a) => cli::eval::cmd_eval(*a),
        Cmd::Memory(a) => cli::eval::cmd_memory(a),
        #[cfg(feature = "serve")]
        Cmd::Serve(a) => cli::serve::cmd_serve(*a),
        Cmd::Report(a) => cli::report::cmd_report(a),
        Cmd::Plot(a) => cli::report::cmd_plot(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {:#}", cli::words::in_user_words(e));
            ExitCode::FAILURE
        }
    }
}
