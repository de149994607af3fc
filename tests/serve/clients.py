"""The official `openai` and `ollama` Python clients against a running `merg serve`.

Run by tests/serve_clients.rs (the README test command) with the pinned clients of
tests/serve/requirements.txt. Exits non-zero with the failed check on any mismatch.

usage: clients.py BASE_URL MODEL_NAME MERG_BIN CHECKPOINT_DIR IMAGE_PNG
"""

import base64
import json
import subprocess
import sys

import ollama
import openai

base, model, merg_bin, ckpt, png = sys.argv[1:6]
N = 12


def merg_generate(prompt, image=None):
    """`merg generate` greedy on the same prompt: what every client must reproduce."""
    cmd = [merg_bin, "generate", "--model", ckpt, "--prompt", prompt, "--max-new-tokens", str(N), "--json", "--kv-memory", "blocks:64"]
    if image:
        cmd += ["--image", image]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["text"]


def check(name, got, want):
    if got != want:
        sys.exit(f"FAILED {name}: {got!r} != {want!r}")
    print(f"ok  {name}")


img_b64 = base64.b64encode(open(png, "rb").read()).decode()
schema = {
    "type": "object",
    "properties": {"emotion": {"type": "string", "enum": ["joy", "sadness", "anger"]}, "intensity": {"type": "integer"}},
    "required": ["emotion", "intensity"],
    "additionalProperties": False,
}
text_prompt, image_prompt = "Hello, how are you today?", "How does she feel?"
want_text, want_image = merg_generate(text_prompt), merg_generate(image_prompt, png)

# --- OpenAI -------------------------------------------------------------------------------
oa = openai.OpenAI(base_url=base + "/v1", api_key="not-needed-on-loopback")
check("openai models", [m.id for m in oa.models.list().data], [model])
r = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": text_prompt}], max_tokens=N, temperature=0)
check("openai greedy text = merg generate", r.choices[0].message.content, want_text)
check("openai usage", r.usage.completion_tokens, N)
image_msg = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{img_b64}"}},
    {"type": "text", "text": image_prompt},
]}]
r = oa.chat.completions.create(model=model, messages=image_msg, max_tokens=N, temperature=0)
check("openai image = merg generate --image", r.choices[0].message.content, want_image)
chunks = list(oa.chat.completions.create(model=model, messages=image_msg, max_tokens=N, temperature=0, stream=True))
check("openai stream = non-stream", "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), want_image)
check("openai stream finish", chunks[-1].choices[0].finish_reason, "length")
r = oa.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Rate the emotion as JSON."}], max_tokens=64, temperature=0,
    response_format={"type": "json_schema", "json_schema": {"name": "rating", "schema": schema, "strict": True}},
)
obj = json.loads(r.choices[0].message.content)
check("openai json_schema valid", (obj["emotion"] in schema["properties"]["emotion"]["enum"], isinstance(obj["intensity"], int), sorted(obj)), (True, True, ["emotion", "intensity"]))
try:
    oa.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    sys.exit("FAILED openai unknown model: no error")
except openai.NotFoundError as e:
    check("openai unknown model is 404", ("gpt-4o" in str(e)), True)
try:
    oa.chat.completions.create(model=model, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}], max_tokens=2)
    sys.exit("FAILED openai remote image: no error")
except openai.BadRequestError as e:
    check("openai remote image URL is 400", "network" in str(e), True)

# --- Ollama -------------------------------------------------------------------------------
ol = ollama.Client(host=base)
check("ollama list", [m.model for m in ol.list().models], [model])
show = ol.show(model)
check("ollama show vision", "vision" in (show.capabilities or []), True)
opts = {"temperature": 0, "num_predict": N}
r = ol.chat(model=model, messages=[{"role": "user", "content": image_prompt, "images": [png]}], options=opts)
check("ollama chat image = merg generate --image", r.message.content, want_image)
parts = list(ol.chat(model=model, messages=[{"role": "user", "content": image_prompt, "images": [png]}], options=opts, stream=True))
check("ollama stream = non-stream", "".join(p.message.content for p in parts), want_image)
check("ollama stream done", (parts[-1].done, parts[-1].eval_count), (True, N))
r = ol.generate(model=model, prompt=text_prompt, options=opts)
check("ollama generate = merg generate", r.response, want_text)
r = ol.chat(model=model, messages=[{"role": "user", "content": "Rate the emotion as JSON."}], format=schema, options={"temperature": 0, "num_predict": 64})
obj = json.loads(r.message.content)
check("ollama format schema valid", (obj["emotion"] in schema["properties"]["emotion"]["enum"], isinstance(obj["intensity"], int)), (True, True))
try:
    ol.chat(model="llama3", messages=[{"role": "user", "content": "hi"}])
    sys.exit("FAILED ollama unknown model: no error")
except ollama.ResponseError as e:
    check("ollama unknown model is 404", (e.status_code, "llama3" in e.error), (404, True))

print("ALL CLIENT CHECKS PASSED")
