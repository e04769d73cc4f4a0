"""The log's HTTP routes on a real proxy: the latest checkpoint, a record's inclusion proofs (tenant-scoped like
the record), consistency proofs, and clear 4xx for what cannot be proven. PostgreSQL too, where several proxies
may share the log."""

from __future__ import annotations

import base64
from pathlib import Path

import aiohttp
import pytest

from proxy.audit.merkle import leaf_hash, verify_consistency, verify_inclusion
from proxy.audit.note import open_checkpoint
from tests.support.audit_databases import KINDS, LOG_KEY_ENV, LOG_SIGNER
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import Harness, running_proxy

TENANTS = [{"name": "acme", "api_key_env": "ACME_KEY"}, {"name": "globex", "api_key_env": "GLOBEX_KEY"}]
ENVIRON = {"ACME_KEY": "sk-acme-1", "GLOBEX_KEY": "sk-globex-2"}
ACME = {"Authorization": "Bearer sk-acme-1"}
GLOBEX = {"Authorization": "Bearer sk-globex-2"}
TRUSTED = [LOG_SIGNER.verifier]
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def _checkpoint(harness: Harness, query: str = "") -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{harness.v1}/log/checkpoint{query}", headers=ACME) as response,
    ):
        return response.status, await response.text()


@pytest.mark.parametrize("store", KINDS)
async def test_an_answer_is_provable_from_the_next_checkpoint(
    replica: FakeReplica, tmp_path: Path, store: str
) -> None:
    async with running_proxy(
        [replica],
        tmp_path,
        store=store,
        tenants=TENANTS,
        environ=ENVIRON,
        log={"signing_key_env": LOG_KEY_ENV},
    ) as harness:
        statuses = [await harness.post("/v1/chat/completions", BODY, headers=ACME) for _ in range(3)]
        record = statuses[1][2]["Stackpin-Record"]
        await harness.proxy.store.integrate()
        status, note = await _checkpoint(harness)
        assert status == 200
        checkpoint, _ = open_checkpoint(note, TRUSTED)
        status, proof = await harness.get(f"/v1/records/{record}/proof", headers=ACME)
        assert status == 200 and proof["checkpoint"]["note"] == note
        [answer] = proof["entries"]
        leaf = leaf_hash(answer["entry"].encode())
        assert base64.b64decode(answer["leaf_hash"]) == leaf
        hashes = [base64.b64decode(h) for h in answer["proof"]]
        verify_inclusion(answer["index"], checkpoint.size, leaf, hashes, checkpoint.root)
        assert (await harness.get(f"/v1/records/{record}/proof", headers=GLOBEX))[0] == 404

        await harness.post("/v1/chat/completions", BODY, headers=GLOBEX)
        await harness.proxy.store.integrate()
        _, later_note = await _checkpoint(harness)
        later, _ = open_checkpoint(later_note, TRUSTED)
        status, consistency = await harness.get(
            f"/v1/log/consistency?from={checkpoint.size}&to={later.size}", headers=ACME
        )
        assert status == 200 and (consistency["from"], consistency["to"]) == (checkpoint.size, later.size)
        verify_consistency(
            checkpoint.size,
            later.size,
            checkpoint.root,
            later.root,
            [base64.b64decode(h) for h in consistency["proof"]],
        )
        status, older = await harness.get(f"/v1/records/{record}/proof?size={checkpoint.size}", headers=ACME)
        assert status == 200 and older["checkpoint"]["tree_size"] == checkpoint.size


async def test_what_cannot_be_proven_is_a_4xx_that_says_why(replica: FakeReplica, tmp_path: Path) -> None:
    async with running_proxy([replica], tmp_path, tenants=TENANTS, environ=ENVIRON) as harness:
        _, _, headers = await harness.post("/v1/chat/completions", BODY, headers=ACME)
        await harness.proxy.store.integrate()
        cases = {
            "/v1/log/consistency": (400, "from is required"),
            "/v1/log/consistency?from=0&to=1": (400, "0 < from <= to"),
            "/v1/log/consistency?from=1&to=9": (400, "latest checkpoint has tree size 1"),
            "/v1/log/consistency?from=x": (400, "must be a tree size"),
            "/v1/log/checkpoint?size=7": (404, "no checkpoint of tree size 7"),
            f"/v1/records/{headers['Stackpin-Record']}/proof?size=5": (404, "no checkpoint of tree size 5"),
            "/v1/records/rec_nobody/proof": (404, "no record"),
        }
        for path, (status, message) in cases.items():
            got, body = await harness.get(path, headers=ACME)
            assert (got, body["error"]["type"] != "server_error") == (status, True), (path, body)
            assert message in body["error"]["message"], (path, body)
        assert (await harness.get("/v1/log/checkpoint"))[0] == 401, (
            "the log's routes need a key like the rest"
        )
