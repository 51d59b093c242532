"""`qwen-mk serve` against the official `openai` client, on a real model.

Starts `qwen-mk serve` (CPU backend by default) on a free loopback port and
checks: /v1/models, chat completion, streaming (a sampled answer streamed
with the same seed equals the whole one), a drawn seed reported and
reproducing its answer, stop strings (whole and streamed), completions, a
tool call with a weather function, greedy chat equal to `qwen-mk generate`,
wrong and missing keys (401), an unknown model (404), an over-long prompt
and n > 1 (400), malformed bodies and an oversized body over raw HTTP with
curl (400 / 413), 8 concurrent clients getting the answers they get alone,
and a client that hangs up mid-stream freeing the engine (the server's log
shows its generation cancelled).

Every request is short and most are greedy (temperature 0), so the CPU
backend runs the whole script in a few minutes. Exits non-zero on any failure; the last
line is `serve-openai: N passed, N failed`.

usage: python serve_openai.py --qwen-mk BIN --model DIR [--backend cpu]
"""

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import openai

KEY = "test-key-123"
MAX_TOKENS = 12
# Only a guard against a hang: far above what any request here needs.
REQUEST_TIMEOUT_S = 600
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {
                    "type": "string",
                    "description": "The city and country, e.g. Paris, France",
                },
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}


class Server:
    """A `qwen-mk serve` child process; its stderr (the log) goes to a file."""

    def __init__(self, binary, model, backend, context):
        self.log_file = tempfile.NamedTemporaryFile(
            mode="w+", prefix="qmk-serve-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            [
                binary, "serve", "--model", model, "--backend", backend,
                "--port", "0", "--api-key", KEY, "--context", str(context),
                "--served-model-name", "qwen-test",
            ],
            stdout=subprocess.PIPE,
            stderr=self.log_file,
            text=True,
        )
        # The first stdout line is the address (printed once the model is
        # loaded and the socket bound).
        line = self.proc.stdout.readline()
        m = re.match(r"listening on (http://\S+)", line)
        if not m:
            self.stop()
            raise RuntimeError(f"the server did not start: {line!r}\n{self.log()}")
        self.url = m.group(1)

    def log(self):
        with open(self.log_file.name) as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Checks:
    def __init__(self):
        self.passed = 0
        self.failed = []

    def run(self, name, fn):
        start = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every failure is reported
            self.failed.append(name)
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        else:
            self.passed += 1
            print(f"ok   {name} ({time.monotonic() - start:.1f} s)", flush=True)


def expect(cond, msg):
    if not cond:
        raise AssertionError(msg)


def expect_status(status, fn):
    try:
        fn()
    except openai.APIStatusError as e:
        expect(e.status_code == status, f"status {e.status_code}, wanted {status}: {e}")
        body = e.response.json()
        err = body.get("error", {})
        expect(
            all(k in err for k in ("message", "type", "param", "code")),
            f"not OpenAI's error shape: {body}",
        )
        return err
    raise AssertionError(f"the request succeeded; wanted {status}")


def curl(url, method="POST", body=None, headers=(), body_file=None):
    """Raw HTTP: returns (status, body text)."""
    cmd = ["curl", "-sS", "-X", method, "-o", "-", "-w", "\n%{http_code}",
           "-m", str(REQUEST_TIMEOUT_S)]
    for h in headers:
        cmd += ["-H", h]
    if body_file is not None:
        cmd += ["--data-binary", f"@{body_file}"]
    elif body is not None:
        cmd += ["--data-binary", body]
    out = subprocess.run(cmd + [url], capture_output=True, text=True, check=True).stdout
    text, _, code = out.rpartition("\n")
    return int(code), text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qwen-mk", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()

    suite_start = time.monotonic()
    server = Server(args.qwen_mk, args.model, args.backend, args.context)
    print(f"server at {server.url} ({time.monotonic() - suite_start:.1f} s to start)", flush=True)
    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key=KEY, timeout=REQUEST_TIMEOUT_S, max_retries=0
    )
    checks = Checks()
    try:
        run_checks(checks, client, server, args)
    finally:
        server.stop()
        log = server.log()
    if checks.failed:
        print("--- server log ---\n" + log[-20000:])
    print(f"total {time.monotonic() - suite_start:.1f} s")
    print(f"serve-openai: {checks.passed} passed, {len(checks.failed)} failed")
    return 1 if checks.failed else 0


def chat(client, content, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model="qwen-test", messages=[{"role": "user", "content": content}], **kw
    )


def streamed_text(stream):
    """Content deltas of a chat stream, its finish reason and usage."""
    text, finish, usage, ids = [], None, None, set()
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                text.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    expect(len(ids) == 1, f"chunks of one stream carry {len(ids)} ids")
    return "".join(text), finish, usage


def run_checks(checks, client, server, args):
    state = {}

    def models():
        ms = client.models.list().data
        expect([m.id for m in ms] == ["qwen-test"], f"models: {ms}")

    def seed_of(r):
        return (r.model_extra or {}).get("seed")

    def chat_whole():
        # Sampled, with a seed: the streamed answer below must be the same.
        r = chat(client, "Write a haiku about the sea.", seed=7, temperature=0.8)
        expect(seed_of(r) == 7, f"seed reported: {seed_of(r)}")
        c = r.choices[0]
        expect(c.message.role == "assistant", c)
        expect(c.message.content, f"empty answer: {r}")
        expect(c.finish_reason in ("stop", "length"), c.finish_reason)
        u = r.usage
        expect(u.completion_tokens <= MAX_TOKENS and u.prompt_tokens > 10, u)
        expect(u.total_tokens == u.prompt_tokens + u.completion_tokens, u)
        state["haiku"] = r

    def chat_streamed():
        whole = state["haiku"]
        stream = chat(
            client, "Write a haiku about the sea.", seed=7, temperature=0.8, stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = streamed_text(stream)
        expect(text == whole.choices[0].message.content, f"{text!r} != {whole.choices[0].message.content!r}")
        expect(finish == whole.choices[0].finish_reason, finish)
        expect(usage == whole.usage, f"{usage} != {whole.usage}")

    def same_as_generate():
        prompt = "Name three primary colors."
        r = chat(client, prompt, max_tokens=16)
        out = subprocess.run(
            [args.qwen_mk, "generate", "--model", args.model, "--backend", args.backend,
             "--temperature", "0", "--max-new-tokens", "16", "--json", "--quiet",
             "--prompt", prompt],
            capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S,
        )
        expect(out.returncode == 0, out.stderr)
        g = json.loads(out.stdout)
        expect(r.choices[0].message.content == g["text"], f"{r.choices[0].message.content!r} != {g['text']!r}")
        expect(r.usage.prompt_tokens == len(g["prompt_ids"]), (r.usage, len(g["prompt_ids"])))
        expect(r.usage.completion_tokens == len(g["output_ids"]), (r.usage, len(g["output_ids"])))

    def drawn_seed_reproduces():
        # No seed: the server draws one and reports it; asking with it gives
        # the same answer.
        a = chat(client, "Say something about rivers.", temperature=1.0)
        seed = seed_of(a)
        expect(isinstance(seed, int), f"no seed in {a}")
        b = chat(client, "Say something about rivers.", temperature=1.0, seed=seed)
        expect(seed_of(b) == seed, (seed_of(b), seed))
        expect(a.choices[0].message.content == b.choices[0].message.content,
               f"{a.choices[0].message.content!r} != {b.choices[0].message.content!r}")

    def stop_string():
        prompt = "Count from one to ten in words, separated by commas."
        whole = chat(client, prompt, max_tokens=16).choices[0].message.content
        words = [w for w in whole.replace(",", " ").split() if len(w) > 2]
        expect(len(words) >= 3, f"too short to cut: {whole!r}")
        stop = words[2]
        want = whole[: whole.index(stop)]
        r = chat(client, prompt, max_tokens=16, stop=[stop, "never-there"])
        expect(r.choices[0].message.content == want, f"{r.choices[0].message.content!r} != {want!r}")
        expect(r.choices[0].finish_reason == "stop", r.choices[0].finish_reason)
        text, finish, _ = streamed_text(chat(client, prompt, max_tokens=16, stop=[stop], stream=True))
        expect(text == want and finish == "stop", (text, want, finish))

    def completions():
        kw = dict(model="qwen-test", prompt="def fibonacci(n):", max_tokens=MAX_TOKENS, temperature=0)
        r = client.completions.create(**kw)
        c = r.choices[0]
        expect(c.text and c.finish_reason in ("stop", "length"), r)
        expect(r.usage.prompt_tokens > 2 and r.usage.completion_tokens <= MAX_TOKENS, r.usage)
        text = "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **kw) if ch.choices)
        expect(text == c.text, f"{text!r} != {c.text!r}")

    def tool_call():
        messages = [{"role": "user", "content": "What is the weather like in Paris, France today?"}]
        r = client.chat.completions.create(
            model="qwen-test", messages=messages, tools=[WEATHER_TOOL],
            temperature=0, max_tokens=48,
        )
        c = r.choices[0]
        expect(c.finish_reason == "tool_calls", f"no tool call: {c}")
        call = c.message.tool_calls[0]
        expect(call.type == "function" and call.function.name == "get_current_weather", call)
        arguments = json.loads(call.function.arguments)
        expect("Paris" in arguments.get("location", ""), arguments)
        # The result goes back, and the model answers in words.
        messages += [
            c.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id,
             "content": json.dumps({"temperature": 22, "unit": "celsius", "sky": "sunny"})},
        ]
        r = client.chat.completions.create(
            model="qwen-test", messages=messages, tools=[WEATHER_TOOL],
            temperature=0, max_tokens=MAX_TOKENS,
        )
        expect(r.choices[0].message.content, r)

    def wrong_key():
        for key in ("wrong-key", KEY + "x"):
            bad = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0,
                                timeout=REQUEST_TIMEOUT_S)
            err = expect_status(401, lambda: bad.models.list())
            expect(err["code"] == "invalid_api_key", err)
        code, _ = curl(server.url + "/v1/models", method="GET")
        expect(code == 401, f"no key: {code}")

    def unknown_model():
        expect_status(404, lambda: client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2))

    def over_long():
        err = expect_status(400, lambda: chat(client, "hello " * (args.context + 50)))
        expect(err["code"] == "context_length_exceeded", err)
        expect_status(400, lambda: chat(client, "hello", max_tokens=args.context + 1))

    def n_above_one():
        expect_status(400, lambda: chat(client, "hello", n=2))

    def raw_http():
        url = server.url + "/v1/chat/completions"
        auth = [f"Authorization: Bearer {KEY}", "Content-Type: application/json"]
        for body in ("{not json", "", "[1, 2]", '{"messages": "hi"}',
                     '{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}'):
            code, text = curl(url, body=body, headers=auth)
            expect(code == 400, f"{body!r}: {code} {text}")
            err = json.loads(text)["error"]
            expect(set(err) == {"message", "type", "param", "code"}, err)
        code, text = curl(url, body='{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
                          headers=auth)
        expect(json.loads(text)["error"]["param"] == "temperature", text)
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            f.write('{"prompt": "' + "x" * (9 << 20) + '"}')
            f.flush()
            code, text = curl(server.url + "/v1/completions", headers=auth, body_file=f.name)
            expect(code == 413, f"oversized body: {code} {text[:200]}")
        code, text = curl(server.url + "/health", method="GET")
        expect(code == 200 and json.loads(text) == {"status": "ok"}, text)
        code, _ = curl(server.url + "/nowhere", method="GET", headers=auth)
        expect(code == 404, code)

    def concurrent_clients():
        prompts = ["Say one word: apple.", "Count from 1 to 5.", "What is 2 + 2?",
                   "Name a planet."]
        alone = [chat(client, p, max_tokens=8).choices[0].message.content for p in prompts]
        expect(len(set(alone)) == len(alone), f"answers too alike to tell apart: {alone}")

        def one(i):
            p = prompts[i % 4]
            if i < 4:
                return i, chat(client, p, max_tokens=8).choices[0].message.content
            return i, streamed_text(chat(client, p, max_tokens=8, stream=True))[0]

        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            results = dict(pool.map(one, range(8)))
        for i, text in results.items():
            expect(text == alone[i % 4], f"client {i}: {text!r} != {alone[i % 4]!r}")

    def disconnect_mid_stream():
        stream = chat(client, "Write a long story about a dragon.", max_tokens=300, stream=True)
        chunk_id = None
        for chunk in stream:
            chunk_id = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                break
        stream.close()
        # The next request is answered; the engine let the abandoned one go.
        r = chat(client, "Say hi.", max_tokens=4)
        expect(r.choices[0].message.content, r)
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        line = None
        while line is None and time.monotonic() < deadline:
            line = next((l for l in server.log().splitlines() if chunk_id in l and "tokens (" in l), None)
            time.sleep(0.2)
        expect(line is not None, f"no log line for {chunk_id}")
        m = re.search(r"completion (\d+) tokens \((\w+)\)", line)
        expect(m and m.group(2) == "cancelled" and int(m.group(1)) < 300, line)

    def log_lines():
        lines = [l for l in server.log().splitlines() if "time to first token" in l]
        expect(len(lines) >= 10, f"{len(lines)} request log lines")
        expect(all(re.search(r"(chatcmpl|cmpl)-\w+: prompt \d+ tokens, completion \d+ tokens", l)
                   and "tok/s" in l for l in lines), lines[:3])

    for name, fn in [
        ("models", models),
        ("chat completion", chat_whole),
        ("streamed chat equals the whole answer", chat_streamed),
        ("greedy chat equals qwen-mk generate", same_as_generate),
        ("completions, whole and streamed", completions),
        ("tool call with a weather function", tool_call),
        ("wrong or missing key: 401", wrong_key),
        ("a drawn seed is reported and reproduces the answer", drawn_seed_reproduces),
        ("stop strings end the answer before them, streamed too", stop_string),
        ("unknown model: 404", unknown_model),
        ("over-long prompt: 400", over_long),
        ("n > 1: 400", n_above_one),
        ("raw HTTP: malformed bodies 400, oversized 413", raw_http),
        ("8 concurrent clients", concurrent_clients),
        ("a client hanging up mid-stream frees the engine", disconnect_mid_stream),
        ("a log line per request", log_lines),
    ]:
        if name == "streamed chat equals the whole answer" and "haiku" not in state:
            checks.run(name, lambda: expect(False, "the chat completion failed"))
            continue
        checks.run(name, fn)


if __name__ == "__main__":
    sys.exit(main())
