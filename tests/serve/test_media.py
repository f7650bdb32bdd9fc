"""Images in the serving engine and the HTTP server on k3-tiny-vl (random weights, CPU): chunked
prefill with media against the model's own forward, preemption, prefix-cache isolation between
images, and 4xx answers for bad images."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image
from starlette.testclient import TestClient

from k3.chat import render
from k3.chat.media import MEDIA_PAD, load_chat_media
from k3.config import k3_tiny_vl
from k3.media import encode_png_data_uri
from k3.data.tokenizer import train_bpe_tokenizer
from k3.model.causal_lm import K3ForCausalLM
from k3.serve.async_engine import AsyncEngine
from k3.serve.engine import Engine, EngineConfig
from k3.serve.media import MediaPrefixHasher, RequestMedia, media_digest, prefill_embeds
from k3.serve.prefix_cache import PrefixHasher
from k3.serve.sampling import SamplingParams
from k3.serve.server import ServerConfig, build_app
from tests.serve.conftest import corpus

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def vl_tok():
    cfg = k3_tiny_vl()
    return train_bpe_tokenizer(corpus(), cfg.text_config.vocab_size)  # specials at the model's ids


@pytest.fixture(scope="module")
def vl_model():
    torch.manual_seed(0)
    return K3ForCausalLM(k3_tiny_vl()).init_weights(seed=0).eval()


def _img(w: int, h: int, seed: int) -> Image.Image:
    a = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    return Image.fromarray(a, "RGB")


def _chat(uri: str, text: str = "what colour is the shape?") -> list[dict]:
    return [{"role": "system", "content": "You look at images."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": text}]}]


def _prompt(tok, model, messages):
    cm = load_chat_media(messages, _vcfg(model))
    ids, _ = render(cm.messages, tok, image_prompts=cm.prompts, add_generation_prompt=True, thinking=False)
    return ids, cm.media


def _vcfg(model):
    from k3.serve.media import vision_config_of

    return vision_config_of(model)


def _engine(model, tok, **kw) -> Engine:
    cfg = {"memory_budget_bytes": 32 << 20, "page_size": 8, "unit_size": 8, "checkpoint_every_units": 2,
           "checkpoint_min_gap": 2, "max_model_len": 1024}
    cfg.update(kw)
    return Engine(model, tok, EngineConfig(**cfg))


def _cold(model, tok, ids, media):
    eng = _engine(model, tok, enable_prefix_cache=False, short_prefill_budget=4096, long_prefill_budget=4096,
                  page_size=64)
    rid = eng.add_request(ids, GREEDY, media=media)
    return _run(eng, rid)


def _run(eng: Engine, rid: str):
    toks, cached = [], None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                toks += o.new_token_ids
                cached = o.cached_tokens
    return toks, cached


def _reference_greedy(model, ids, media, n):
    """Full-sequence forwards (no cache) through K3ForCausalLM.forward(media=...), then sampled tokens
    appended as plain embeddings."""
    x = model.embed_with_media(torch.tensor([ids]), media=media)
    out = []
    with torch.no_grad():
        for _ in range(n):
            h, _ = model.model(inputs_embeds=x)
            t = int(model.lm_head(h[0, -1]).argmax())
            out.append(t)
            x = torch.cat([x, model.model.embed_tokens(torch.tensor([[t]]))], 1)
    return out


def test_chunked_media_prefill_matches_reference(vl_model, vl_tok):
    ids, media = _prompt(vl_tok, vl_model, _chat(encode_png_data_uri(_img(70, 45, 1))))
    pads = [i for i, t in enumerate(ids) if t == vl_tok.special_id(MEDIA_PAD)]
    assert len(pads) == 3 * 2
    # a 5-token budget splits the image's 6 pads over two chunks
    eng = _engine(vl_model, vl_tok, short_prefill_budget=5, long_prefill_budget=5)
    rid = eng.add_request(ids, GREEDY, media=media)
    chunked, _ = _run(eng, rid)
    assert chunked == _cold(vl_model, vl_tok, ids, media)[0] == _reference_greedy(vl_model, ids, media, 4)
    # with the model's own first-token logits as well
    with torch.no_grad():
        ref = vl_model(torch.tensor([ids]), media=media).logits[0, -1]
    assert chunked[0] == int(ref.argmax())


def test_video_and_two_images_in_one_prompt(vl_model, vl_tok):
    frames = [encode_png_data_uri(_img(40, 30, s)) for s in (4, 5, 6)]
    msgs = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": encode_png_data_uri(_img(30, 60, 7))}},
        {"type": "video", "video": frames},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": encode_png_data_uri(_img(29, 29, 8))}}]}]
    ids, media = _prompt(vl_tok, vl_model, msgs)
    assert [m.dim() for m in media] == [3, 4, 3]
    assert ids.count(vl_tok.special_id(MEDIA_PAD)) == 3 * 2 + 2 * (2 * 2) + 2 * 2  # 60x30, 3 frames, 29x29
    eng = _engine(vl_model, vl_tok, short_prefill_budget=7, long_prefill_budget=7)
    chunked, _ = _run(eng, eng.add_request(ids, GREEDY, media=media))
    assert chunked == _reference_greedy(vl_model, ids, media, 4)


def test_images_change_the_output_and_are_encoded_once(vl_model, vl_tok, monkeypatch):
    calls = []
    real = vl_model.encode_media
    monkeypatch.setattr(vl_model, "encode_media", lambda m: calls.append(len(m)) or real(m))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0)
    lps = []
    for seed in (1, 2):
        ids, media = _prompt(vl_tok, vl_model, _chat(encode_png_data_uri(_img(56, 56, seed))))
        eng = _engine(vl_model, vl_tok, short_prefill_budget=10, long_prefill_budget=10)
        rid = eng.add_request(ids, params, media=media)
        while eng.has_unfinished():
            for o in eng.step():
                if o.request_id == rid and o.new_logprobs:
                    lps.append(o.new_logprobs[0][0])
    assert calls == [1, 1]  # one encoder call per request, however many prefill chunks
    assert lps[0] != lps[1]


def test_preempted_media_request_resumes_identically(vl_model, vl_tok):
    ids, media = _prompt(vl_tok, vl_model, _chat(encode_png_data_uri(_img(60, 90, 3))))
    eng = _engine(vl_model, vl_tok, short_prefill_budget=6, long_prefill_budget=6)
    rid = eng.add_request(ids, GREEDY, media=media)
    toks = []
    for k in range(40):
        if k == 3:  # mid-prompt: the state is donated, readmission resumes from a checkpoint or restarts
            eng.scheduler.preempt(eng.requests[rid])
        for o in eng.step():
            toks += o.new_token_ids
        if not eng.has_unfinished():
            break
    assert toks == _cold(vl_model, vl_tok, ids, media)[0]


def test_prefix_cache_isolates_images(vl_model, vl_tok):
    a = encode_png_data_uri(_img(56, 56, 10))
    b = encode_png_data_uri(_img(56, 56, 11))
    ids_a, media_a = _prompt(vl_tok, vl_model, _chat(a))
    ids_b, media_b = _prompt(vl_tok, vl_model, _chat(b))
    assert ids_a == ids_b  # same tokens, different pixels
    first_pad = ids_a.index(vl_tok.special_id(MEDIA_PAD))
    eng = _engine(vl_model, vl_tok)
    out_a, cached_a = _run(eng, eng.add_request(ids_a, GREEDY, media=media_a))
    assert cached_a == 0
    out_b, cached_b = _run(eng, eng.add_request(ids_b, GREEDY, media=media_b))
    assert 0 < cached_b <= first_pad  # the system prompt is shared, the image is not
    assert out_b == _cold(vl_model, vl_tok, ids_b, media_b)[0]
    # the same image again (decoded afresh: equal pixels, new tensors) hits past the image
    ids_a2, media_a2 = _prompt(vl_tok, vl_model, _chat(a))
    out_a2, cached_a2 = _run(eng, eng.add_request(ids_a2, GREEDY, media=media_a2))
    assert cached_a2 == len(ids_a) - 1 and out_a2 == out_a
    assert out_a == _cold(vl_model, vl_tok, ids_a, media_a)[0]


def test_media_hasher_keys():
    toks = list(range(40))
    x, y = torch.zeros(3, 28, 28), torch.ones(3, 28, 28)
    assert media_digest(x) == media_digest(x.clone()) != media_digest(y)
    assert media_digest(x) != media_digest(torch.zeros(3, 28, 29)) != media_digest(torch.zeros(1, 3, 28, 28))
    plain = PrefixHasher(toks, 8)
    hx = MediaPrefixHasher(toks, 8, [(20, 24, media_digest(x))])
    hy = MediaPrefixHasher(toks, 8, [(20, 24, media_digest(y))])
    for pos in (1, 8, 16, 20):  # before the image: identical to a text-only prompt
        assert hx.key(pos) == hy.key(pos) == plain.key(pos)
    for pos in (21, 24, 30, 39):
        assert hx.key(pos) != hy.key(pos)
    assert hx.anchor(2) == hy.anchor(2) and hx.anchor(3) != hy.anchor(3)


def test_prefill_embeds_splices_only_prompt_media_rows(vl_model):
    pad = vl_model.config.media_placeholder_token_id
    d = vl_model.config.text_config.hidden_size

    class R:
        pass

    r = R()
    rows = torch.randn(3, d)
    r.media = RequestMedia(rows, np.array([2, 3, 4]), [(2, 5, b"x")])
    r.num_computed = 3
    other = R()
    other.media, other.num_computed = None, 0
    # chunk [3, 8) of r: pads at 3, 4 (media rows 1, 2) and a sampled pad at 6 (an ordinary token)
    ids = torch.tensor([[pad, pad, 7, pad, 9, 5, 6]])
    x = prefill_embeds(vl_model, ids, [(r, 5), (other, 2)])
    plain = vl_model.model.embed_tokens(ids)
    torch.testing.assert_close(x[0, 0], rows[1])
    torch.testing.assert_close(x[0, 1], rows[2])
    torch.testing.assert_close(x[0, 2:], plain[0, 2:])
    assert prefill_embeds(vl_model, ids[:, 5:], [(other, 2)]) is None


def test_engine_rejects_bad_media(vl_model, vl_tok, model, tokenizer):
    ids, media = _prompt(vl_tok, vl_model, _chat(encode_png_data_uri(_img(30, 30, 0))))
    eng = _engine(vl_model, vl_tok)
    with pytest.raises(ValueError, match="4 <|media_pad|> tokens|media placeholder"):
        eng.add_request(ids, GREEDY, media=media + media)
    with pytest.raises(ValueError, match="media\\[0\\] must be a float image"):
        eng.add_request(ids, GREEDY, media=[torch.zeros(3, 30, 30, dtype=torch.uint8)])
    text_only = Engine(model, tokenizer, EngineConfig(memory_budget_bytes=16 << 20, page_size=8, unit_size=8))
    with pytest.raises(ValueError, match="no vision encoder"):
        text_only.add_request([1, 2, 3], GREEDY, media=[torch.zeros(3, 28, 28)])
    with pytest.raises(ValueError, match="tokenizer's <\\|media_pad\\|> id"):
        Engine(vl_model, tokenizer, EngineConfig(memory_budget_bytes=16 << 20, page_size=8, unit_size=8))
    assert not eng.has_unfinished()


# ------------------------------------------------------------------------------------------------ HTTP


@pytest.fixture(scope="module")
def vl_client(vl_model, vl_tok):
    eng = _engine(vl_model, vl_tok)
    cfg = ServerConfig(model_names=("k3-tiny-vl",), default_max_tokens=4, max_image_bytes=200_000)
    with TestClient(build_app(AsyncEngine(eng), vl_tok, cfg)) as client:
        yield client


def _post(client, content, **body):
    body = {"model": "k3-tiny-vl", "messages": [{"role": "user", "content": content}], "temperature": 0, **body}
    return client.post("/v1/chat/completions", json=body)


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_http_chat_with_png_data_uri(vl_client, tmp_path):
    img = _img(84, 56, 5)
    r = _post(vl_client, [_image_part(encode_png_data_uri(img)), {"type": "text", "text": "describe"}])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 4
    assert body["usage"]["prompt_tokens"] > 2 * 3  # the image's 6 media tokens are in the prompt
    path = tmp_path / "x.png"
    img.save(path)
    r2 = _post(vl_client, [_image_part(str(path)), {"type": "text", "text": "describe"}])
    assert r2.status_code == 200 and r2.json()["choices"][0]["message"] == body["choices"][0]["message"]
    usage = r2.json()["usage"]  # the same pixels from a file: a hit past the image
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    r3 = _post(vl_client, [_image_part(encode_png_data_uri(img))], stream=True)
    assert r3.status_code == 200 and r3.text.rstrip().endswith("data: [DONE]")


def _png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("url, match", [
    ("data:image/png;base64,", "image is empty"),
    ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n garbage").decode(), "cannot decode"),
    ("data:image/png;base64,%%%", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(_png_bytes(Image.new("RGB", (3585, 1)))).decode(),
     "largest supported side is 3584"),
    ("data:image/png;base64," + base64.b64encode(np.random.default_rng(0).bytes(300_000)).decode(),
     "200000-byte limit"),
    ("https://example.com/cat.png", "no network access"),
    ("/no/such/image.png", "not found"),
])
def test_http_bad_images_are_400(vl_client, url, match):
    r = _post(vl_client, [{"type": "text", "text": "see"}, _image_part(url)])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_image" and err["param"] == "messages[0].content[1].image_url"
    assert match in err["message"]
    ok = _post(vl_client, [_image_part(encode_png_data_uri(_img(28, 28, 0)))])
    assert ok.status_code == 200  # the server keeps serving


def test_http_malformed_parts_and_context(vl_client):
    r = _post(vl_client, [{"type": "image_url", "image_url": {"nourl": 1}}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].image_url"
    r = _post(vl_client, [{"type": "input_audio", "input_audio": {}}])
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content"
    r = _post(vl_client, "look: <|kimi_image_placeholder|>")
    assert r.status_code == 400 and "image_url content parts" in r.json()["error"]["message"]
    big = encode_png_data_uri(Image.new("RGB", (900, 900)))  # 33 x 33 = 1089 media tokens > 1024 context
    r = _post(vl_client, [_image_part(big)])
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------------------------ live


def test_live_k3_serve_vl_checkpoint(tmp_path, vl_model, vl_tok):
    """`k3 serve --checkpoint` on a saved k3-tiny-vl checkpoint: a PNG data URI is answered, bad
    images get 400 and the server keeps serving."""
    import json
    import os
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    from tests.serve.conftest import _free_port

    vl_model.save_pretrained(tmp_path)
    vl_tok.save(tmp_path)
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "k3", "serve", "--checkpoint", str(tmp_path), "--port", str(port), "--threads", "1",
           "--served-model-name", "k3-tiny-vl", "--memory-budget-mb", "32", "--page-size", "16", "--unit-size", "64",
           "--max-model-len", "2048", "--default-max-tokens", "4", "--max-image-mb", "0.5"]
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=root)
    base = f"http://127.0.0.1:{port}"

    def post(url: str) -> tuple[int, dict]:
        body = {"model": "k3-tiny-vl", "temperature": 0, "messages": [{"role": "user", "content": [
            _image_part(url), {"type": "text", "text": "What colour is the shape?"}]}]}
        req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, log.read_text()
            time.sleep(0.3)
        status, body = post(encode_png_data_uri(_img(84, 56, 7)))
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 4 and body["usage"]["prompt_tokens"] > 6
        for bad, code in [("data:image/png;base64,iVBORw0KGgo=", "invalid_image"),
                          ("data:image/png;base64,", "invalid_image"),
                          (encode_png_data_uri(Image.new("RGB", (4000, 4))), "invalid_image"),
                          (encode_png_data_uri(_img(600, 600, 1)), "invalid_image")]:  # > 0.5 MB
            status, body = post(bad)
            assert status == 400 and body["error"]["code"] == code, body
        assert post(encode_png_data_uri(_img(28, 28, 2)))[0] == 200
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
