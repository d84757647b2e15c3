"""Long-connection mode (lark-oapi's websocket client) against a hostile or broken peer: frames that
are not frames, frames with missing or absurd headers, payloads that are not callbacks, a client
configuration meant to stop it, and dropped connections. The bot (a real process) must go on
answering its HTTP endpoints, and card actions must still arrive once the peer behaves again."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import requests
import yaml
from lark_oapi.ws.pb.pbbp2_pb2 import Frame

from tests.alertbot.conftest import TOKEN, alert, webhook
from tests.support.feishu_callbacks import card_action_event, data_frame
from tests.support.feishu_server import FeishuServer
from tests.support.services import free_port, running

AUTH = {"Authorization": f"Bearer {TOKEN}"}
BOB = "ou_bob"


def bot_config(tmp_path: Path, feishu: FeishuServer, port: int) -> Path:
    cfg = {
        "listen": f"127.0.0.1:{port}",
        "auth": {"bearer_token": TOKEN},
        "store": {"path": str(tmp_path / "bot.db")},
        "dedupe": {"storm_threshold": 0},
        "feishu": {
            "base_url": feishu.url,
            "app": {"app_id": feishu.app_id, "app_secret": feishu.app_secret, "chats": {"P0": "oc_p0"}},
            "callback": {"mode": "long_connection"},
        },
        "oncall": {
            "roster": [{"name": "bob", "open_id": BOB}],
            "rotation_start": "2026-01-05T09:00:00+00:00",
        },
    }
    path = tmp_path / "bot.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def hostile_frames() -> list[bytes | str]:
    """What a broken or hostile peer sends down the websocket, one message each."""
    pong = Frame(SeqID=0, LogID=0, service=7, method=0)
    pong.headers.add(key="type", value="pong")
    # a client configuration meant to stop the client: ping without pause, never reconnect
    pong.payload = json.dumps(
        {"PingInterval": 0, "ReconnectCount": 0, "ReconnectInterval": 10**9, "ReconnectNonce": -5}
    ).encode()
    bad_pong = Frame(SeqID=0, LogID=0, service=7, method=0, payload=b"{not json")
    bad_pong.headers.add(key="type", value="pong")
    event = json.dumps(card_action_event("", BOB, {"episode": 1, "action": "claim"}, "om_1")).encode()
    return [
        "a text message, not a protobuf frame",
        b"\xff\xfe\x00 not a frame at all",
        data_frame(b"{}", method=9).SerializeToString(),  # no such frame type
        data_frame(event, message_id=None).SerializeToString(),  # a header missing
        data_frame(event, sum="many").SerializeToString(),
        data_frame(event, sum="2", seq="7").SerializeToString(),  # a part past the whole
        data_frame(event, sum="2", seq="-1").SerializeToString(),
        data_frame(event, sum=str(10**12), seq="0").SerializeToString(),  # a trillion parts, joining one
        data_frame(event, message_id="msg-huge", sum=str(10**12), seq="0").SerializeToString(),  # ... or new
        data_frame(event, type="no-such-type").SerializeToString(),
        data_frame(b"{not json").SerializeToString(),
        data_frame(b'{"schema": "2.0", "header": {"event_type": "im.unknown"}}').SerializeToString(),
        data_frame("\udcff".encode("utf-8", "surrogatepass")).SerializeToString(),
        bad_pong.SerializeToString(),
        pong.SerializeToString(),
    ]


def test_a_hostile_websocket_peer_stops_neither_the_bot_nor_its_callbacks(
    tmp_path: Path, feishu: FeishuServer
) -> None:
    ws = feishu.serve_long_connection()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "megatrace.cli",
        "alertbot",
        "--config",
        str(bot_config(tmp_path, feishu, port)),
    ]
    with running(argv, f"{base}/healthz", tmp_path / "bot.log") as bot:
        item = alert("MegatraceRankHang", job="llm", rank="3")
        assert (
            requests.post(f"{base}/alertmanager", json=webhook(item), headers=AUTH, timeout=10).status_code
            == 200
        )
        feishu.wait_for(lambda: len(feishu.messages()) >= 1)
        card = feishu.messages()[0].message_id  # an action names the card it came from
        assert ws.connected.wait(30), feishu.summary()
        for message in hostile_frames():
            ws.send_raw(message)
        ws.drop_newest()  # then the connection goes: the client must come back despite the config
        deadline = time.monotonic() + 60
        while ws.connections < 2 and time.monotonic() < deadline and bot.poll() is None:
            time.sleep(0.1)
        log = (tmp_path / "bot.log").read_text(errors="replace")
        assert ws.connections >= 2, f"the client did not reconnect:\n{log[-12000:]}"
        answer = ws.push(card_action_event("", BOB, {"episode": 1, "action": "claim"}, card), timeout=30)
        assert answer == {"code": 200, "data": {"toast": {"type": "success", "content": "claimed"}}}
        assert bot.poll() is None
        assert requests.get(f"{base}/healthz", timeout=10).status_code == 200
        again = alert("MegatraceRankHang", job="other", rank="1")
        assert (
            requests.post(f"{base}/alertmanager", json=webhook(again), headers=AUTH, timeout=10).status_code
            == 200
        )
        assert ws.pings <= 60, f"{ws.pings} pings: the client was talked into pinging without pause"
