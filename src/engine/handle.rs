//! A cloneable, thread-safe front door to one engine. The engine lives on its own thread;
//! callers on any thread prepare their requests themselves (tokens, media preprocessing,
//! schema compilation: `RequestPreparer`), then hand them over and read a stream of events.
//! Requests that arrive together are batched together, and any request can be aborted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::engine::{Completion, Engine, EngineStats};
use super::error::{EngineError, EngineResult};
use super::request::{ChatRequest, PreparedRequest, RequestPreparer};
use super::sequence::SeqId;
use crate::models::ModelSpec;

/// Identifies a request to its handle (for `abort`).
pub type RequestId = u64;

/// What a request's stream yields: each sampled token as it is produced, then exactly one
/// `Finished` or `Error`.
#[derive(Debug)]
pub enum Event {
    Token { token: u32, logprob: f32 },
    Finished(Completion),
    Error(EngineError),
}

enum Msg {
    Submit(RequestId, Box<PreparedRequest>, Sender<Event>),
    Abort(RequestId),
    Stats(Sender<EngineStats>),
    Shutdown,
}

#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Msg>,
    preparer: RequestPreparer,
    spec: Arc<ModelSpec>,
    next_id: Arc<AtomicU64>,
}

pub struct EngineThread {
    pub handle: EngineHandle,
    join: Option<JoinHandle<()>>,
}

impl EngineThread {
    pub fn spawn(mut engine: Engine) -> Self {
        let (tx, rx) = channel::<Msg>();
        let preparer = engine.preparer().clone();
        let spec = Arc::new(engine.model().spec().clone());
        let join = std::thread::spawn(move || {
            crate::cpu::adopt_thread();
            serve(&mut engine, rx)
        });
        let handle = EngineHandle { tx, preparer, spec, next_id: Arc::new(AtomicU64::new(0)) };
        EngineThread { handle, join: Some(join) }
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

/// The stream has delivered its last event (or the engine is gone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamEnded;

/// The events of one request, with a way to abort it.
pub struct RequestStream {
    id: RequestId,
    rx: Receiver<Event>,
    tx: Sender<Msg>,
}

impl RequestStream {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Next event; `None` once the stream has ended.
    pub fn next_event(&self) -> Option<Event> {
        self.rx.recv().ok()
    }

    /// Next event if one arrives within `timeout`: `Ok(None)` on timeout, `Err(())` once the
    /// stream has ended. Lets a caller poll for its own cancellation (a client gone away).
    pub fn next_event_timeout(&self, timeout: std::time::Duration) -> Result<Option<Event>, StreamEnded> {
        match self.rx.recv_timeout(timeout) {
            Ok(e) => Ok(Some(e)),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Ok(None),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(StreamEnded),
        }
    }

    /// Stops generation; the stream then ends with `Finished` (reason `Aborted`, the tokens so
    /// far kept) unless the request had already finished.
    pub fn abort(&self) {
        let _ = self.tx.send(Msg::Abort(self.id));
    }

    /// Waits for the end, skipping token events.
    pub fn wait(self) -> EngineResult<Completion> {
        loop {
            match self.rx.recv() {
                Ok(Event::Token { .. }) => continue,
                Ok(Event::Finished(c)) => return Ok(c),
                Ok(Event::Error(e)) => return Err(e),
                Err(_) => return Err(EngineError::ShutDown),
            }
        }
    }
}

/// Dropping a stream before its end aborts the request (a client that went away), so the
/// engine stops spending steps and blocks on it. After the end this is a no-op.
impl Drop for RequestStream {
    fn drop(&mut self) {
        let _ = self.tx.send(Msg::Abort(self.id));
    }
}

impl Iterator for RequestStream {
    type Item = Event;
    fn next(&mut self) -> Option<Event> {
        self.next_event()
    }
}

impl EngineHandle {
    /// What the engine knows of its model (layers, vocabulary, context, special ids).
    pub fn model_spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Caller-side preparation: token counts, the tokenizer, the context window.
    pub fn preparer(&self) -> &RequestPreparer {
        &self.preparer
    }

    /// Prepares `req` on the calling thread (the engine keeps stepping meanwhile), then queues
    /// it. A bad request fails here, before it reaches the engine.
    pub fn submit(&self, req: ChatRequest) -> EngineResult<RequestStream> {
        let prepared = self.preparer.prepare(req)?;
        self.submit_prepared(prepared)
    }

    /// Queues an already prepared request.
    pub fn submit_prepared(&self, req: PreparedRequest) -> EngineResult<RequestStream> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = channel();
        self.tx.send(Msg::Submit(id, Box::new(req), tx)).map_err(|_| EngineError::ShutDown)?;
        Ok(RequestStream { id, rx, tx: self.tx.clone() })
    }

    /// Submits and waits for the completion.
    pub fn generate(&self, req: ChatRequest) -> EngineResult<Completion> {
        self.submit(req)?.wait()
    }

    /// Aborts request `id` (see `RequestStream::abort`).
    pub fn abort(&self, id: RequestId) {
        let _ = self.tx.send(Msg::Abort(id));
    }

    pub fn stats(&self) -> EngineResult<EngineStats> {
        let (tx, rx) = channel();
        self.tx.send(Msg::Stats(tx)).map_err(|_| EngineError::ShutDown)?;
        rx.recv().map_err(|_| EngineError::ShutDown)
    }
}

/// Requests in flight on the engine thread.
#[derive(Default)]
struct Waiting {
    by_seq: HashMap<SeqId, (RequestId, Sender<Event>)>,
    seq_of: HashMap<RequestId, SeqId>,
}

impl Waiting {
    fn insert(&mut self, req: RequestId, seq: SeqId, tx: Sender<Event>) {
        self.by_seq.insert(seq, (req, tx));
        self.seq_of.insert(req, seq);
    }

    fn remove(&mut self, seq: SeqId) -> Option<Sender<Event>> {
        let (req, tx) = self.by_seq.remove(&seq)?;
        self.seq_of.remove(&req);
        Some(tx)
    }

    fn fail_all(&mut self, e: &EngineError) {
        for (_, (_, tx)) in self.by_seq.drain() {
            let _ = tx.send(Event::Error(e.clone()));
        }
        self.seq_of.clear();
    }
}

fn serve(engine: &mut Engine, rx: Receiver<Msg>) {
    let mut waiting = Waiting::default();
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
                Msg::Submit(id, req, reply) => match engine.add_prepared(*req) {
                    Ok(seq) => waiting.insert(id, seq, reply),
                    Err(e) => {
                        let _ = reply.send(Event::Error(e));
                    }
                },
                Msg::Abort(id) => {
                    let Some(&seq) = waiting.seq_of.get(&id) else { continue };
                    if let (Some(c), Some(tx)) = (engine.abort(seq), waiting.remove(seq)) {
                        let _ = tx.send(Event::Finished(c));
                    }
                }
                Msg::Stats(reply) => {
                    let _ = reply.send(engine.stats());
                }
                Msg::Shutdown => {
                    waiting.fail_all(&EngineError::ShutDown);
                    return;
                }
            }
        }
        if engine.has_pending() && !step(engine, &mut waiting) {
            return;
        }
    }
}

/// One engine step; streams its tokens and delivers finished requests. A failed step fails
/// every waiting request.
fn step(engine: &mut Engine, waiting: &mut Waiting) -> bool {
    match engine.step() {
        Ok(out) => {
            for (seq, token, logprob) in out.tokens {
                if let Some((_, tx)) = waiting.by_seq.get(&seq) {
                    let _ = tx.send(Event::Token { token, logprob });
                }
            }
            for (seq, c) in out.finished {
                if let Some(tx) = waiting.remove(seq) {
                    let _ = tx.send(Event::Finished(c));
                }
            }
            for (seq, e) in out.failed {
                if let Some(tx) = waiting.remove(seq) {
                    let _ = tx.send(Event::Error(e));
                }
            }
            true
        }
        Err(e) => {
            waiting.fail_all(&e);
            false
        }
    }
}
