"""Engine replicas on Ray Serve (chapter 17), run for real: `nanoserve serve --data-parallel-size 2` on a local Ray
cluster with two CPU replicas of a tiny model, driven by the official `openai` client. Greedy answers equal one
engine's; follow-ups find their prefix cached on the replica the router sends them to; streams, errors and keys as on
one server; per-replica metrics and health; an abort reaches the replica; a replica whose scheduler (or whose own
process) is killed under its requests fails them with a 503, not a hang, and Ray Serve replaces it while the endpoint
keeps answering. The faults are made deterministic by freezing a scheduler (SIGSTOP) before the requests it must hold.
Skipped where Ray is not installed (`pip install nanoserve[ray]`)."""
import ipaddress, json, os, selectors, signal, socket, struct, threading, time
from concurrent.futures import ThreadPoolExecutor
import pytest

pytest.importorskip('ray.serve')
import httpx
import openai
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from nanoserve.llm import LLM
from nanoserve.req import SamplingParams
from nanoserve.testing import ServerProcess, process_gone, save_tiny_model, wait_until
psutil = pytest.importorskip('psutil')     # Ray's own dependency

# Per replica; max_model_len is the model's 512. 2048 KV slots: the four documents (about 310 tokens each) fit one
# replica's cache together, since where each lands depends on the replicas' random ids (rendezvous hashing).
ENGINE = dict(device='cpu', page_size=4, num_pages=512)
KEY = 'sk-replicas'
PROMPTS = ['The capital of France is', 'Colours:', 'def main():', 'Numbers: 0 1 2', 'Once upon a time', 'SELECT *',
           'Dear Sir,', 'import torch']
DOCUMENTS = [f'Document {k}: ' + ' '.join(f'{word}{k * 7 + i}' for i, word in enumerate(['alpha', 'beta', 'gamma', 'delta'] * 12))
             for k in range(4)]
QUESTIONS = ['Who wrote it?', 'When was it?', 'Why does it matter?']
LIMIT = 256             # connections at once (--limit-concurrency): more than any test but the one of the limit opens
DOORS = dict(timeout_keep_alive=2, limit_concurrency=LIMIT)   # the front door's knobs, the same on both servers

@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp('models') / 'tiny-llama', 'llama', tokenizer=True))

@pytest.fixture(scope='module')
def server(model_dir):
    s = ServerProcess(model_dir, cli=True, served_model_name='tiny', data_parallel_size=2, api_key=KEY,
                      max_request_bytes=1 << 20, **DOORS, **ENGINE).start()
    yield s
    replica_pids = [pid for pids in s.state()['pids'].values() for pid in pids.values()]
    assert s.stop(signal.SIGTERM, timeout=120) == 0
    for pid in replica_pids: assert process_gone(pid, timeout=30), f'process {pid} outlived the server'

@pytest.fixture(scope='module')
def llm(model_dir): return LLM(model_dir, **ENGINE)          # one engine on the same weights

@pytest.fixture(scope='module')
def client(server): return OpenAI(base_url=server.url + '/v1', api_key=KEY, max_retries=0, timeout=120)

def _replicas(server, n: int = 2, timeout: float = 120.0) -> dict:
    "`/debug/state` once `n` replicas report their processes and counters."
    def ready():
        state = server.state()
        pids, stats = state['pids'], state['stats']
        return state if len(pids) == n and all(pids.values()) and all(stats.get(i) for i in pids) else None
    return wait_until(ready, f'{n} engine replicas reporting', timeout)

def _per_replica(server, name: str) -> dict[str, float]:
    "One engine metric from `/metrics`, by replica."
    text = httpx.get(server.url + '/metrics').text
    return {s.labels['replica']: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and 'replica' in s.labels}

def _greedy(llm, prompt, n=12):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0].outputs[0]

def _complete(client, prompt, max_tokens=12, **kw):
    return client.completions.create(model='tiny', prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={'ignore_eos': True}, **kw)

# -- the endpoint ---------------------------------------------------------------------------------------------------
def test_health_models_and_replica_metrics(server, client):
    state = _replicas(server)
    assert httpx.get(server.url + '/health').status_code == 200
    assert all(set(pids) == {'replica', 'scheduler', 'tokenizer'} for pids in state['pids'].values())
    models = client.models.list().data
    assert [m.id for m in models] == ['tiny'] and models[0].model_extra['max_model_len'] == 512
    assert httpx.get(server.url + '/v1/models').status_code == 401          # the key guards the API, not /health
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + '/metrics').text)}
    for name in ['nanoserve:num_requests_running', 'nanoserve:num_requests_waiting', 'nanoserve:kv_cache_usage_perc',
                 'nanoserve:prefix_cache_hit_rate', 'nanoserve:integrity_ok']:
        assert {s.labels.get('replica') for s in families[name].samples} == set(state['pids']), name
    for name in ['nanoserve:prompt_tokens', 'nanoserve:time_to_first_token_seconds']:   # the endpoint's own
        assert name in families and all('replica' not in s.labels for s in families[name].samples), name

def test_greedy_answers_equal_one_engine(server, client, llm):
    _replicas(server)
    queries_before = _per_replica(server, 'nanoserve:prefix_cache_queries_total')
    refs = [_greedy(llm, p).text for p in PROMPTS]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda p: _complete(client, p).choices[0].text, PROMPTS * 2))
    assert texts == refs * 2
    def both_served():
        queries = _per_replica(server, 'nanoserve:prefix_cache_queries_total')
        return len([i for i, q in queries.items() if q > queries_before.get(i, 0)]) == 2
    wait_until(both_served, 'both replicas answering some of them', 30)
    r = _complete(client, [PROMPTS[0], PROMPTS[2]], 6, n=2)
    assert [c.text for c in r.choices] == [_greedy(llm, PROMPTS[0], 6).text] * 2 + [_greedy(llm, PROMPTS[2], 6).text] * 2
    ids = llm.tokenizer(PROMPTS[3]).input_ids
    assert _complete(client, ids, 6).choices[0].text == _greedy(llm, PROMPTS[3], 6).text
    msgs = [{'role': 'system', 'content': 'You are terse.'}, {'role': 'user', 'content': 'What is the capital of France?'}]
    ref = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    r = client.chat.completions.create(model='tiny', messages=msgs, max_tokens=10, temperature=0, extra_body={'ignore_eos': True})
    assert r.choices[0].message.content == ref.outputs[0].text and r.usage.prompt_tokens == len(ref.prompt_token_ids)

def test_streams_equal_and_usage(client, llm):
    ref = _greedy(llm, PROMPTS[1])
    chunks = list(_complete(client, PROMPTS[1], stream=True, stream_options={'include_usage': True}))
    assert ''.join(c.choices[0].text for c in chunks[:-1]) == ref.text
    assert chunks[-2].choices[0].finish_reason == 'length' and chunks[-1].usage.completion_tokens == 12
    msgs = [{'role': 'user', 'content': 'Hi there'}]
    want = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    chunks = list(client.chat.completions.create(model='tiny', messages=msgs, max_tokens=8, temperature=0, stream=True,
                                                 extra_body={'ignore_eos': True}))
    assert chunks[0].choices[0].delta.role == 'assistant'
    assert ''.join(c.choices[0].delta.content or '' for c in chunks) == want

def test_follow_ups_find_their_prefix_cached(server, client):
    "Each document's first question is computed; its follow-ups go to the same replica and find the document cached."
    def ask(doc_and_question):
        document, question = doc_and_question
        return _complete(client, f'{document}\nQuestion: {question}', 4).usage
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(ask, [(d, 'What is it?') for d in DOCUMENTS]))
        usages = list(pool.map(ask, [(d, q) for d in DOCUMENTS for q in QUESTIONS]))
    ratios = [u.prompt_tokens_details.cached_tokens / u.prompt_tokens for u in usages]
    assert all(r >= 0.8 for r in ratios), ratios
    chat = lambda question: client.chat.completions.create(
        model='tiny', max_tokens=4, temperature=0,
        messages=[{'role': 'system', 'content': DOCUMENTS[0]}, {'role': 'user', 'content': question}]).usage
    chat('What is it?')
    follow_up = chat('Who wrote it?')
    assert follow_up.prompt_tokens_details.cached_tokens >= 0.8 * follow_up.prompt_tokens, follow_up

def test_tokenize_through_a_replica(server, model_dir):
    "`/tokenize` and `/detokenize` (chapter 14i) are answered by a replica's tokenizer: the HF tokenizer's ids."
    from transformers import AutoTokenizer
    tok, headers = AutoTokenizer.from_pretrained(model_dir), {'Authorization': f'Bearer {KEY}'}
    r = httpx.post(server.url + '/tokenize', json={'prompt': PROMPTS[0]}, headers=headers, timeout=60).json()
    assert r['tokens'] == tok(PROMPTS[0]).input_ids
    text = httpx.post(server.url + '/detokenize', json={'tokens': r['tokens'][1:]}, headers=headers, timeout=60).json()
    assert text == {'prompt': PROMPTS[0]}
    refused = httpx.post(server.url + '/detokenize', json={'tokens': [10**6]}, headers=headers, timeout=60)
    assert refused.status_code == 400 and refused.json()['error']['param'] == 'tokens'

def test_error_envelope(server, client):
    def envelope(r: httpx.Response) -> dict:
        body = r.json()
        assert set(body) == {'error'} and set(body['error']) == {'message', 'type', 'param', 'code'}, body
        return body['error']
    headers = {'Authorization': f'Bearer {KEY}'}
    r = httpx.post(server.url + '/v1/completions', json={'model': 'tiny', 'prompt': 'x', 'temperature': -1}, headers=headers)
    assert r.status_code == 400 and envelope(r)['param'] == 'temperature'
    with pytest.raises(openai.BadRequestError) as e:                  # found by the replica's tokenizer
        client.completions.create(model='tiny', prompt='hello ' * 1000, max_tokens=4)
    assert 'maximum context length' in e.value.message and e.value.code == 'context_length_exceeded'
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model='nope', messages=[{'role': 'user', 'content': 'x'}])
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=server.url + '/v1', api_key='wrong', max_retries=0).models.list()
    r = httpx.post(server.url + '/v1/completions', content=b'x' * (2 << 20), headers={**headers, 'content-type': 'application/json'})
    assert r.status_code == 413 and envelope(r)

# -- the front door: one server's guards ---------------------------------------------------------------------------
@pytest.fixture(scope='module')
def single(model_dir):
    "One engine's server, with the same front door, for what both must do alike."
    with ServerProcess(model_dir, served_model_name='tiny', api_key=KEY, **DOORS, **ENGINE) as s: yield s

def _address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix('http://').split(':')
    return host, int(port)

def _answer(server, head: bytes) -> str:
    "Send `head` (in a thread: the server may close before it is all sent) and return the status line, or 'closed'."
    sock = socket.create_connection(_address(server), timeout=60)
    def send():
        try: sock.sendall(head)
        except OSError: pass
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    data = b''
    try:
        while b'\r\n' not in data:
            chunk = sock.recv(65536)
            if not chunk: break
            data += chunk
    except ConnectionResetError: pass
    finally:
        sock.close()
        sender.join(10)
    return data.split(b'\r\n', 1)[0].decode() if data else 'closed'

def _closed_by_server(socks: list, wait: float) -> int:
    "How many of `socks` the server closed (or answered) within `wait` seconds (a bound on a hang, not a target)."
    sel, closed, deadline = selectors.DefaultSelector(), 0, time.monotonic() + wait
    for sock in socks: sel.register(sock, selectors.EVENT_READ)
    while closed < len(socks) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.2):
            sel.unregister(key.fileobj)
            closed += 1
    sel.close()
    return closed

def test_ray_listens_on_loopback_only(server):
    "With `--host 127.0.0.1` and a cluster of its own, every process the server started listens on loopback only."
    _replicas(server)
    root = psutil.Process(server.proc.pid)
    listening = []
    for proc in [root, *root.children(recursive=True)]:
        try: name, sockets = proc.name(), proc.net_connections(kind='inet')
        except psutil.NoSuchProcess: continue      # a short-lived helper that exited meanwhile
        listening += [(name, s.laddr.ip, s.laddr.port) for s in sockets if s.status == psutil.CONN_LISTEN]
    names = {name for name, _, _ in listening}
    assert {'gcs_server', 'raylet'} <= names, names    # Ray's own servers are in the tree, not only the endpoint's
    def loopback(ip):
        address = ipaddress.ip_address(ip)
        return (getattr(address, 'ipv4_mapped', None) or address).is_loopback     # '::ffff:127.0.0.1' is too
    assert [(name, ip, port) for name, ip, port in listening if not loopback(ip)] == []

def test_ray_serve_routes_are_not_served(server):
    "Only the app's routes answer, behind the key: no Ray Serve proxy route (`/-/routes`, `/-/healthz`) is reachable."
    for path in ['/-/routes', '/-/healthz']:
        assert httpx.get(server.url + path).status_code == 401, path
        assert httpx.get(server.url + path, headers=server.headers).status_code == 404, path

def test_oversized_headers_are_refused(server):
    "A 1 MB header never reaches the app: uvicorn's HTTP parser refuses a head past its limit (16 KiB) and closes."
    big = f'GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nX-Big: '.encode() + b'x' * (1 << 20)
    answer = _answer(server, big + b'\r\n\r\n')
    assert answer == 'closed' or answer.split()[1] in ('400', '431'), answer
    ok = _answer(server, f'GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n'.encode())
    assert ok.split()[1] == '200', ok

def test_idle_and_half_sent_connections_are_closed(server):
    "Connections that send nothing, or a request head a byte at a time, are closed after `timeout_keep_alive`."
    idle = [socket.create_connection(_address(server)) for _ in range(20)]
    slow = [socket.create_connection(_address(server)) for _ in range(20)]
    stop = threading.Event()
    def trickle():                 # a head that never ends: a byte from each every 0.5 s (slowloris)
        for sock in slow: sock.sendall(b'GET /v1/models HTTP/1.1\r\nHost: x\r\n')
        while not stop.wait(0.5):
            for sock in slow:
                try: sock.send(b'X')
                except OSError: pass
    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try: assert _closed_by_server(idle + slow, 60) == 40
    finally:
        stop.set()
        thread.join()
        for sock in idle + slow: sock.close()

def test_connections_past_the_limit_get_503(server):
    "With `LIMIT` connections busy (their bodies still coming), the next request gets a quick 503, then none once they go."
    head = (f'POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n'
            'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{').encode()
    held = []
    try:
        for _ in range(LIMIT):
            held.append(socket.create_connection(_address(server)))
            held[-1].sendall(head)
        assert wait_until(lambda: httpx.get(server.url + '/health').status_code == 503, 'a 503 past the limit', 30)
    finally:
        for sock in held: sock.close()
    wait_until(lambda: httpx.get(server.url + '/health').status_code == 200, 'the server answering again', 60)

def _tree_rss_mb(pid: int) -> float:
    "The resident memory of process `pid` and all its descendants (Ray's processes, the replicas, their workers)."
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try: total += proc.memory_info().rss
        except psutil.NoSuchProcess: pass
    return total / 2**20

def _stream_storm(server, count: int = 200, max_tokens: int = 400):
    "`count` streams opened at once and left unread for 2 s, then reset (RST) while their tokens still come."
    body = json.dumps({'model': 'tiny', 'prompt': 'Once upon a time', 'max_tokens': max_tokens, 'stream': True,
                       'ignore_eos': True}).encode()
    head = (f'POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n'
            f'Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n').encode()
    socks = []
    for _ in range(count):
        sock = socket.create_connection(_address(server), timeout=120)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(head + body)
        socks.append(sock)
    time.sleep(2.0)                      # the streams start; nothing is read: their tokens pile up in the server
    for sock in socks:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))
        sock.close()

@pytest.mark.parametrize('door', ['single', 'server'])
def test_memory_steady_after_stream_storms(door, request):
    "Three storms of 200 reset streams: the second and third leave the server's processes no larger than the first."
    s = request.getfixturevalue(door)
    settled = lambda: s.state()['open_requests'] == 0
    rss = []
    for _ in range(3):
        _stream_storm(s)
        wait_until(settled, 'every stormed request ended', 120)
        time.sleep(3.0)                  # the aborts reach the schedulers, the replicas' calls end
        rss.append(_tree_rss_mb(s.proc.pid))
    assert rss[2] - rss[0] < 64, rss     # one storm's working set may stay; repeating it adds nothing
    assert httpx.get(s.url + '/health').status_code == 200

# -- faults ---------------------------------------------------------------------------------------------------------
def _settled_queries(server, timeout: float = 60.0) -> dict:
    "Each replica's prefix-cache queries once two reports 2 s apart agree (reports lag a second or so)."
    last, deadline = None, time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = {i: s['prefix_queries'] for i, s in _replicas(server)['stats'].items()}
        if now == last: return now
        last = now
        time.sleep(2.0)
    raise AssertionError(f'the replicas\' counts did not settle within {timeout} s')

def _holder(server, client, prompt: str) -> str:
    "Send `prompt` and return the replica that computed it (the one whose prefix-cache queries grew)."
    before = _settled_queries(server)
    _complete(client, prompt, 2)
    def grown():
        stats = server.state()['stats']
        grew = [i for i in before if i in stats and stats[i]['prefix_queries'] > before[i]]
        return grew[0] if len(grew) == 1 else None
    return wait_until(grown, 'a replica counting the prompt', 30)

def _open_requests(server) -> int: return server.state()['open_requests']

def test_abort_reaches_the_replica(server, client):
    "A client that leaves a stream while its replica's scheduler is frozen: the replica aborts it, nothing runs on."
    prompt = DOCUMENTS[1] + '\nQuestion: abort me'
    replica = _holder(server, client, prompt)
    scheduler = server.state()['pids'][replica]['scheduler']
    aborted = server.state()['stats'][replica]['aborted']
    os.kill(scheduler, signal.SIGSTOP)
    try:
        body = {'model': 'tiny', 'prompt': prompt, 'max_tokens': 200, 'temperature': 0, 'stream': True}
        with pytest.raises(httpx.ReadTimeout):      # nothing comes while the scheduler is frozen; the client leaves
            with httpx.stream('POST', server.url + '/v1/completions', json=body, timeout=3,
                              headers={'Authorization': f'Bearer {KEY}'}) as r: r.read()
        wait_until(lambda: _open_requests(server) == 0, 'the ingress dropping the request', 30)
        time.sleep(1.0)                             # the cancelled call reaches the replica, its abort the tokenizer
    finally: os.kill(scheduler, signal.SIGCONT)
    stats = wait_until(lambda: (lambda s: s if s['aborted'] > aborted and not s['running'] and not s['waiting'] else None)(
        server.state()['stats'][replica]), 'the abort counted and the replica idle', 30)
    assert stats['integrity'] == 'ok' and stats['locked_pages'] == 0

def _frozen_requests(server, client, replica: str, prompt: str, count: int = 3) -> tuple[list, list[threading.Thread]]:
    "Freeze `replica`'s scheduler and start `count` follow-ups of `prompt` (routed to it); they wait, open."
    os.kill(server.state()['pids'][replica]['scheduler'], signal.SIGSTOP)
    results = [None] * count
    def ask(k: int):
        try: results[k] = _complete(client, prompt + f' {k}', 8)
        except openai.APIStatusError as e: results[k] = e
    threads = [threading.Thread(target=ask, args=(k,)) for k in range(count)]
    for t in threads: t.start()
    wait_until(lambda: _open_requests(server) == count, f'{count} requests open', 30)
    # open at the endpoint is not yet inside the replica: one Ray Serve has not handed over is routed to a live replica
    inside = lambda: server.state()['stats'].get(replica, {}).get('open_requests') == count
    wait_until(inside, f'{count} requests open in replica {replica}', 30)
    return results, threads

def _replaced(server, client, llm, gone: str):
    "The endpoint answers again, and Ray Serve has started a replica in place of `gone`."
    wait_until(lambda: _answers(client), 'the endpoint answering', 120)
    state = wait_until(lambda: (lambda s: s if gone not in s['pids'] else None)(_replicas(server)), 'a new replica', 120)
    with ThreadPoolExecutor(4) as pool:          # both replicas serve, and answer as one engine does
        assert list(pool.map(lambda p: _complete(client, p).choices[0].text, PROMPTS)) == [_greedy(llm, p).text for p in PROMPTS]
    return state

def _answers(client) -> bool:
    try: return bool(_complete(client, PROMPTS[0], 2).choices)
    except openai.APIStatusError: return False

def test_killed_scheduler_fails_its_requests_and_is_replaced(server, client, llm):
    prompt = DOCUMENTS[2] + '\nQuestion: which replica?'
    replica = _holder(server, client, prompt)
    pids = server.state()['pids'][replica]
    results, threads = _frozen_requests(server, client, replica, prompt)
    os.kill(pids['scheduler'], signal.SIGKILL)
    for t in threads: t.join(60)
    assert not any(t.is_alive() for t in threads), 'a request of the killed replica hung'
    assert all(isinstance(r, openai.APIStatusError) and r.status_code == 503 for r in results), results
    assert 'scheduler' in results[0].message
    _replaced(server, client, llm, replica)
    assert process_gone(pids['replica'], timeout=30) and process_gone(pids['tokenizer'], timeout=30)

def test_killed_replica_fails_its_requests_and_is_replaced(server, client, llm):
    prompt = DOCUMENTS[3] + '\nQuestion: which replica now?'
    replica = _holder(server, client, prompt)
    pids = server.state()['pids'][replica]
    results, threads = _frozen_requests(server, client, replica, prompt)
    os.kill(pids['replica'], signal.SIGKILL)
    for t in threads: t.join(60)
    os.kill(pids['scheduler'], signal.SIGKILL)      # frozen by the test, it would never see its parent go
    assert not any(t.is_alive() for t in threads), 'a request of the killed replica hung'
    assert all(isinstance(r, openai.APIStatusError) and r.status_code == 503 for r in results), results
    _replaced(server, client, llm, replica)
    assert process_gone(pids['tokenizer'], timeout=30)
