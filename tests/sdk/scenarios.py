"""Scenarios run with the official OpenAI Python SDK against Envoy with the ComputeFlux filter.

Why: real clients parse answers, raise their own error classes and retry on their own terms
(honouring Retry-After); the filter must keep working for them. tests/envoy/sdk.rs starts the mock
upstreams and Envoy, runs `python tests/sdk/scenarios.py <scenario>` and asserts on the JSON
line a scenario prints last, together with what the mocks saw.

Environment: OPENAI_BASE_URL (Envoy, ending in /v1), OPENAI_API_KEY, SCENARIO_ARGS (a JSON
object: e.g. the mocks' control ports). Every SDK check that the scenario can decide alone is
an assertion here; a failed one exits non-zero with its traceback.
"""

import json
import os
import sys
import time
import urllib.request

import openai

ARGS = json.loads(os.environ.get("SCENARIO_ARGS") or "{}")
ENDPOINT = "x-computeflux-endpoint"


def client(**kw):
    kw.setdefault("timeout", 20.0)
    return openai.OpenAI(**kw)


def set_fault(control_port, fault):
    """POST /_mock/fault on a mock's control port."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{control_port}/_mock/fault",
        data=json.dumps(fault).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200, r.status


def chat():
    """Two turns of one conversation (session header), parsed by the SDK."""
    c = client()
    seen = []
    messages = [{"role": "user", "content": "hello from the sdk"}]
    for turn in range(2):
        raw = c.chat.completions.with_raw_response.create(
            model=ARGS["model"],
            messages=messages,
            extra_headers={"x-session-id": "sdk-chat-1"},
        )
        completion = raw.parse()
        assert isinstance(completion, openai.types.chat.ChatCompletion)
        text = completion.choices[0].message.content
        assert completion.choices[0].finish_reason == "stop"
        assert completion.usage.prompt_tokens > 0
        seen.append(
            {
                "endpoint": raw.headers.get(ENDPOINT),
                "affinity": raw.headers.get("x-computeflux-affinity"),
                "text": text,
                "model": completion.model,
            }
        )
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"turn {turn + 2}"}]
    return {"turns": seen}


def stream():
    """A streamed chat completion: chunks arrive, the usage chunk comes last."""
    c = client()
    chunks = c.chat.completions.create(
        model=ARGS["model"],
        messages=[{"role": "user", "content": "stream please"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    text, count, usage, finish = "", 0, None, None
    for chunk in chunks:
        assert isinstance(chunk, openai.types.chat.ChatCompletionChunk)
        count += 1
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop", finish
    return {"text": text, "chunks": count, "completion_tokens": usage}


def models():
    """models.list(): every model the fleet serves."""
    page = client().models.list()
    ids = [m.id for m in page]
    for m in page:
        assert m.object == "model", m
    return {"ids": ids}


def embeddings():
    """Embeddings as the SDK asks for them (base64, decoded by the SDK) and as floats."""
    c = client()
    raw = c.embeddings.with_raw_response.create(model=ARGS["model"], input=["alpha", "beta"])
    default = raw.parse()
    assert [d.index for d in default.data] == [0, 1]
    floats = c.embeddings.create(model=ARGS["model"], input=["alpha", "beta"], encoding_format="float")
    again = c.embeddings.create(model=ARGS["model"], input="alpha")
    vectors = [d.embedding for d in default.data]
    assert all(len(v) == 8 for v in vectors), vectors
    assert vectors[0] != vectors[1]
    # The SDK's base64 decoding and the float answer agree; the same text, the same vector.
    for a, b in zip(vectors, [d.embedding for d in floats.data]):
        assert all(abs(x - y) < 1e-6 for x, y in zip(a, b)), (a, b)
    assert again.data[0].embedding == vectors[0]
    return {"endpoint": raw.headers.get(ENDPOINT), "model": default.model, "dims": len(vectors[0])}


def transcription():
    """A multipart upload: the answer names the model the upstream received."""
    audio = bytes(range(256)) * 64  # 16 KiB of "audio"
    raw = client().audio.transcriptions.with_raw_response.create(
        model=ARGS["model"], file=("clip.wav", audio, "audio/wav")
    )
    t = raw.parse()
    return {"endpoint": raw.headers.get(ENDPOINT), "text": t.text, "bytes": len(audio)}


def responses():
    """The Responses API over several turns, each continuing the previous response."""
    c = client()
    turns = []
    # The first turn streamed: the filter must learn the id from the first SSE event.
    first_id, first_text = None, ""
    with c.responses.with_streaming_response.create(
        model=ARGS["model"], input="first question", stream=True
    ) as raw:
        endpoint = raw.headers.get(ENDPOINT)
        for event in raw.parse():
            if event.type == "response.created":
                first_id = event.response.id
            elif event.type == "response.output_text.delta":
                first_text += event.delta
    assert first_id, "no response.created event"
    turns.append({"id": first_id, "endpoint": endpoint, "text": first_text})
    previous = first_id
    for n in range(2, ARGS.get("turns", 4) + 1):
        raw = c.responses.with_raw_response.create(
            model=ARGS["model"], input=f"question {n}", previous_response_id=previous
        )
        r = raw.parse()
        assert r.previous_response_id == previous, r.previous_response_id
        turns.append({"id": r.id, "endpoint": raw.headers.get(ENDPOINT), "text": r.output_text})
        previous = r.id
    return {"turns": turns}


def errors():
    """The SDK's error classes for the filter's and the upstream's 400 / 404 / 413 / 429 / 503,
    and its own retry honouring Retry-After."""
    out = {}
    m = ARGS["model"]
    msgs = [{"role": "user", "content": "hi"}]
    once = client(max_retries=0)

    try:
        once.chat.completions.create(model="", messages=msgs)
        raise AssertionError("400 expected")
    except openai.BadRequestError as e:
        out["400"] = {"status": e.status_code, "code": e.code, "type": e.type}

    try:
        once.chat.completions.create(model="no-such-model", messages=msgs)
        raise AssertionError("404 expected")
    except openai.NotFoundError as e:
        out["404"] = {"status": e.status_code, "code": e.code}

    try:
        big = [{"role": "user", "content": "x" * (ARGS["max_body_bytes"] + 1)}]
        once.chat.completions.create(model=m, messages=big)
        raise AssertionError("413 expected")
    except openai.APIStatusError as e:
        out["413"] = {"status": e.status_code, "code": e.code, "class": type(e).__name__}

    # Upstream failures, passed through (a single endpoint: nowhere to fail over to). The
    # 503s come first: a failure while the breaker is half-open after a 429 would re-open it.
    control = ARGS["control_port"]
    set_fault(control, {"mode": "status", "status": 503, "count": 1})
    try:
        once.chat.completions.create(model=m, messages=msgs)
        raise AssertionError("503 expected")
    except openai.InternalServerError as e:
        out["503"] = {"status": e.status_code}

    retrying = client(max_retries=3)
    set_fault(control, {"mode": "status", "status": 503, "count": 1})
    raw = retrying.chat.completions.with_raw_response.create(model=m, messages=msgs)
    raw.parse()
    out["503_retried"] = {"retries_taken": raw.retries_taken}

    set_fault(control, {"mode": "status", "status": 429, "retry_after": "1", "count": 1})
    try:
        once.chat.completions.create(model=m, messages=msgs)
        raise AssertionError("429 expected")
    except openai.RateLimitError as e:
        out["429"] = {"status": e.status_code, "retry_after": e.response.headers.get("retry-after")}
    time.sleep(1.2)  # let the endpoint's rate-limit window pass

    # The SDK retries a 429 itself, waiting as long as Retry-After says (its own backoff
    # would be about 0.5 s): the call succeeds after at least that long.
    set_fault(control, {"mode": "status", "status": 429, "retry_after": "2", "count": 1})
    start = time.monotonic()
    raw = retrying.chat.completions.with_raw_response.create(model=m, messages=msgs)
    raw.parse()
    out["429_retried"] = {
        "elapsed_s": time.monotonic() - start,
        "retries_taken": raw.retries_taken,
    }
    return out


def pin_cookie():
    """A conversation through two Envoy replicas with `pin_cookie`, as behind a load balancer:
    the SDK's own HTTP client keeps the cookie the failover answer sets and sends it to the other
    replica, which never saw the failover. A client without the cookie goes home there."""
    # The SDK's own default HTTP client, shared by the two base URLs (one cookie jar).
    jar_client = openai.DefaultHttpxClient()
    one = client(http_client=jar_client)
    two = client(http_client=jar_client, base_url=ARGS["other_base_url"])
    session = {"x-session-id": "sdk-cookie-1"}
    messages = [{"role": "user", "content": "hello from the sdk"}]
    turns = []

    def turn(c, label):
        raw = c.chat.completions.with_raw_response.create(
            model=ARGS["model"], messages=messages, extra_headers=session
        )
        completion = raw.parse()
        assert isinstance(completion, openai.types.chat.ChatCompletion)
        messages.extend(
            [
                {"role": "assistant", "content": completion.choices[0].message.content},
                {"role": "user", "content": f"after {label}"},
            ]
        )
        turns.append(
            {
                "label": label,
                "endpoint": raw.headers.get(ENDPOINT),
                "affinity": raw.headers.get("x-computeflux-affinity"),
                "set_cookie": raw.headers.get("set-cookie"),
            }
        )
        return turns[-1]

    home = turn(one, "first")["endpoint"]
    set_fault(ARGS["control_ports"][home], {"mode": "status", "status": 429, "retry_after": "30"})
    turn(one, "failover")
    set_fault(ARGS["control_ports"][home], {"mode": "none"})
    # Control: a client without the cookie, through replica two (home healthy there).
    bare = client(http_client=openai.DefaultHttpxClient(), base_url=ARGS["other_base_url"])
    raw = bare.chat.completions.with_raw_response.create(
        model=ARGS["model"], messages=messages, extra_headers=session
    )
    control = raw.headers.get(ENDPOINT)
    turn(two, "other replica")
    cookies = sorted(c.name for c in jar_client.cookies.jar)
    return {"home": home, "turns": turns, "control": control, "cookies": cookies}


SCENARIOS = {
    f.__name__: f
    for f in (chat, stream, models, embeddings, transcription, responses, errors, pin_cookie)
}

if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else ""
    if name not in SCENARIOS:
        sys.exit(f"usage: scenarios.py {{{'|'.join(SCENARIOS)}}}")
    result = SCENARIOS[name]()
    result["sdk_version"] = openai.__version__
    print(json.dumps(result))
