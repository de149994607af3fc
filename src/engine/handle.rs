//! A cloneable, thread-safe front door to one engine. The engine lives on its own thread;
//! callers on any thread submit requests and block on (or poll) their own reply channel, and
//! requests that arrive together are batched together.

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

use anyhow::{anyhow, Result};

use super::engine::{ChatRequest, Completion, Engine, EngineStats};
use super::sequence::SeqId;

enum Msg {
    Submit(ChatRequest, Sender<Result<Completion>>),
    Stats(Sender<EngineStats>),
    Inspect(Box<dyn FnOnce(&Engine) + Send>),
    Shutdown,
}

#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Msg>,
}

pub struct EngineThread {
    pub handle: EngineHandle,
    join: Option<JoinHandle<()>>,
}

impl EngineThread {
    pub fn spawn(mut engine: Engine) -> Self {
        let (tx, rx) = channel::<Msg>();
        let join = std::thread::spawn(move || serve(&mut engine, rx));
        EngineThread { handle: EngineHandle { tx }, join: Some(join) }
    }
}

impl Drop for EngineThread {
    fn drop(&mut self) {
        let _ = self.handle.tx.send(Msg::Shutdown);
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

impl EngineHandle {
    /// Queues a request; the receiver yields its completion (or its own error).
    pub fn submit(&self, req: ChatRequest) -> Receiver<Result<Completion>> {
        let (tx, rx) = channel();
        if let Err(e) = self.tx.send(Msg::Submit(req, tx)) {
            if let Msg::Submit(_, reply) = e.0 {
                let _ = reply.send(Err(anyhow!("engine has shut down")));
            }
        }
        rx
    }

    /// Submits and waits.
    pub fn generate(&self, req: ChatRequest) -> Result<Completion> {
        self.submit(req).recv().map_err(|_| anyhow!("engine thread ended"))?
    }

    /// Runs `f` on the engine thread between steps (e.g. to count a prompt's tokens with the
    /// engine's tokenizer) and returns its result.
    pub fn inspect<T: Send + 'static>(&self, f: impl FnOnce(&Engine) -> T + Send + 'static) -> Result<T> {
        let (tx, rx) = channel();
        let job: Box<dyn FnOnce(&Engine) + Send> = Box::new(move |e| {
            let _ = tx.send(f(e));
        });
        self.tx.send(Msg::Inspect(job)).map_err(|_| anyhow!("engine has shut down"))?;
        rx.recv().map_err(|_| anyhow!("engine thread ended"))
    }

    pub fn stats(&self) -> Result<EngineStats> {
        let (tx, rx) = channel();
        self.tx.send(Msg::Stats(tx)).map_err(|_| anyhow!("engine has shut down"))?;
        rx.recv().map_err(|_| anyhow!("engine thread ended"))
    }
}

fn serve(engine: &mut Engine, rx: Receiver<Msg>) {
    let mut waiting: HashMap<SeqId, Sender<Result<Completion>>> = HashMap::new();
    loop {
        // Block only when there is nothing to compute; otherwise take what has arrived.
        let mut msgs = vec![];
        if !engine.has_pending() {
            match rx.recv() {
                Ok(m) => msgs.push(m),
                Err(_) => return, // every handle is gone
            }
        }
        msgs.extend(rx.try_iter());
        for m in msgs {
            match m {
                Msg::Submit(req, reply) => match engine.add_request(req) {
                    Ok(id) => {
                        waiting.insert(id, reply);
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                },
                Msg::Stats(reply) => {
                    let _ = reply.send(engine.stats());
                }
                Msg::Inspect(job) => job(engine),
                Msg::Shutdown => {
                    for (_, r) in waiting.drain() {
                        let _ = r.send(Err(anyhow!("engine shut down before the request finished")));
                    }
                    return;
                }
            }
        }
        if engine.has_pending() && !step(engine, &mut waiting) {
            return;
        }
    }
}

/// One engine step; delivers finished requests. A failed step fails every waiting request.
fn step(engine: &mut Engine, waiting: &mut HashMap<SeqId, Sender<Result<Completion>>>) -> bool {
    match engine.step() {
        Ok(done) => {
            for (id, c) in done {
                if let Some(r) = waiting.remove(&id) {
                    let _ = r.send(Ok(c));
                }
            }
            true
        }
        Err(e) => {
            let msg = format!("{e:#}");
            for (_, r) in waiting.drain() {
                let _ = r.send(Err(anyhow!("engine step failed: {msg}")));
            }
            false
        }
    }
}
