"""pytest's harness: before any test imports triton, choose Triton's interpreter when there is no GPU (chapter 95)."""
from nanoserve.testing import use_triton_interpreter

use_triton_interpreter()

import os
import pytest

# The CPU backend picks its linear product by timing the candidates at load (appendix B), so on a busy machine two
# processes of one test (a server and its offline reference, two TP ranks) can pick different ones and round fp32 sums
# differently. The tests pin the C product, as `NANOSERVE_CPU_LINEAR` lets any user; appendix B tests each product.
os.environ.setdefault('NANOSERVE_CPU_LINEAR', 'c')

def pytest_configure(config):
    config.addinivalue_line('markers', 'slow: runs a real model (SmolLM2); skipped unless NANOSERVE_SLOW=1')

def pytest_collection_modifyitems(config, items):
    if os.environ.get('NANOSERVE_SLOW'): return
    for item in items:
        if 'slow' in item.keywords: item.add_marker(pytest.mark.skip(reason='slow: set NANOSERVE_SLOW=1 to run'))

# -- every response the tests read is strict JSON ---------------------------------------------------------------------
# The servers' answers are parsed as a strict client parses them: no NaN, no Infinity (json.loads accepts both). The
# check wraps the body iterators of httpx and httpx2, which every client of the tests reads through (httpx's functions,
# httpx.Client, the openai SDK and starlette's TestClient on httpx2): a JSON body once read whole, and each complete
# `data:` line of an event stream, even one left early.
import json
import httpx
import httpx2

STRICT_JSON_VIOLATIONS: list[str] = []

def _refuse_constant(name: str): raise ValueError(f'{name} is not JSON')

def check_strict_json(response, body: bytes, complete: bool):
    "Record in STRICT_JSON_VIOLATIONS each JSON body, or complete event of a stream, that a strict parser refuses."
    kind = response.headers.get('content-type', '')
    text = body.decode('utf-8', errors='replace')
    if kind.startswith('application/json'): payloads = [text] if complete and text else []
    elif kind.startswith('text/event-stream'):
        lines = text.split('\n') if complete else text.split('\n')[:-1]
        payloads = [line[5:].strip() for line in lines if line.startswith('data:')]
        payloads = [p for p in payloads if p != '[DONE]']
    else: return
    for payload in payloads:
        try: json.loads(payload, parse_constant=_refuse_constant)
        except ValueError as e:
            request = response._request    # None for a response made by hand (a mock transport)
            where = f'{request.method} {request.url}' if request is not None else 'a response'
            STRICT_JSON_VIOLATIONS.append(f'{where}: {e}: {payload[:200]}')

def _check_bodies(response_class):
    "Wrap `response_class`'s byte iterators so that what they yield is checked once they end."
    iter_bytes, aiter_bytes = response_class.iter_bytes, response_class.aiter_bytes
    def checked_iter_bytes(self, *args, **kwargs):
        seen, complete = [], False
        try:
            for chunk in iter_bytes(self, *args, **kwargs):
                seen.append(chunk)
                yield chunk
            complete = True
        finally: check_strict_json(self, b''.join(seen), complete)
    async def checked_aiter_bytes(self, *args, **kwargs):
        seen, complete = [], False
        try:
            async for chunk in aiter_bytes(self, *args, **kwargs):
                seen.append(chunk)
                yield chunk
            complete = True
        finally: check_strict_json(self, b''.join(seen), complete)
    response_class.iter_bytes, response_class.aiter_bytes = checked_iter_bytes, checked_aiter_bytes

for _response_class in (httpx.Response, httpx2.Response): _check_bodies(_response_class)

@pytest.fixture(autouse=True)
def strict_json_responses():
    "Fail the test if a response it (or a fixture before it) read was not strict JSON."
    start = len(STRICT_JSON_VIOLATIONS)
    yield
    found = STRICT_JSON_VIOLATIONS[start:]
    del STRICT_JSON_VIOLATIONS[start:]
    assert not found, 'responses that are not strict JSON:\n' + '\n'.join(found)
