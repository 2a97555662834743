"""--l2-url spellings (kvedit/server/l2_url.py) and the chunk key's hash tag (l2_redis.py).

The parser is checked against what a user writes (redis, rediss, unix, valkey spellings,
cluster host lists, AUTH/ACL, TLS options) and refuses bad URLs naming what is wrong; the key
names are checked against redis-py's own slot function (CRC16 of the hash tag), the one Redis
Cluster uses.
"""
from __future__ import annotations

import pytest

from kvedit.server.l2_url import parse, redacted

redis = pytest.importorskip("redis", reason="the `redis` client is missing: pip install -e '.[l2]'")


@pytest.mark.parametrize("url, cluster, tls, nodes, user, password", [
    ("redis://127.0.0.1:6379/0", False, False, (("127.0.0.1", 6379),), None, None),
    ("rediss://u:p%40w@h:1/2", False, True, (("h", 1),), "u", "p@w"),
    ("valkey://h", False, False, (("h", 6379),), None, None),
    ("valkeys://:pw@h:7", False, True, (("h", 7),), None, "pw"),
    ("unix:///tmp/r.sock", False, False, (), None, None),
    ("redis+cluster://h1:1,h2:2,h3", True, False, (("h1", 1), ("h2", 2), ("h3", 6379)),
     None, None),
    ("rediss+cluster://user:pw@h1:1,h2:2/?ssl_cert_reqs=none", True, True,
     (("h1", 1), ("h2", 2)), "user", "pw"),
    ("valkey+cluster://[::1]:7000", True, False, (("::1", 7000),), None, None),
    ("valkeys+cluster://:pw@h:1/0", True, True, (("h", 1),), None, "pw"),
])
def test_spellings(url, cluster, tls, nodes, user, password):
    t = parse(url)
    assert (t.cluster, t.tls, t.nodes, t.username, t.password) == \
        (cluster, tls, nodes, user, password)


def test_single_urls_map_onto_redis_py_schemes_and_keep_options():
    assert parse("valkeys://:pw@h:7/3").single_url == "rediss://:pw@h:7/3"
    assert parse("rediss+cluster://h:1/?ssl_cert_reqs=none").options == \
        (("ssl_cert_reqs", "none"),)


@pytest.mark.parametrize("url, message", [
    ("http://x", "must start with one of"),
    ("redis+cluster://", "names no node"),
    ("redis+cluster://h:1/3", "only database 0"),
    ("redis+cluster://h:x", "is not host or host:port"),
    ("redis+cluster://h:99999", "is not host or host:port"),
    ("redis://h:x", "Port could not be cast"),
])
def test_bad_urls_say_what_is_wrong(url, message):
    with pytest.raises(ValueError, match=message):
        parse(url)


def test_passwords_are_masked_in_cluster_urls_too():
    assert redacted("redis+cluster://u:hunter2@h1:1,h2:2/?x=1") == \
        "redis+cluster://u:***@h1:1,h2:2/?x=1"
    assert redacted("redis://:hunter2@h:1/0") == "redis://:***@h:1/0"
    assert redacted("redis://h:1/0") == "redis://h:1/0"


def test_payload_and_meta_share_the_chunk_keys_slot():
    from redis.crc import key_slot

    from kvedit.server.l2_redis import META_SUFFIX, redis_key
    keys = [bytes([i]) * 16 for i in range(64)]
    rks = [redis_key("kvedit", "m", "abc", 0, k) for k in keys]
    assert all(key_slot(rk) == key_slot(rk + META_SUFFIX) for rk in rks)
    assert len({key_slot(rk) for rk in rks}) > 32            # chunks spread over slots
    # the slot is the chunk key's alone: any model, layout or rank of that chunk key lands
    # together, and braces in a model name do not move the tag
    assert key_slot(redis_key("p", "a{b}c", "t", 1, keys[0])) == key_slot(rks[0])
    assert key_slot(redis_key("p", "x{}y", "t", 1, keys[0])) == key_slot(rks[0])


def test_model_names_stay_apart_after_escaping():
    from kvedit.server.l2_redis import redis_key
    k = b"\x01" * 16
    names = ["a{b", "a%7Bb", "a_b", "a}b", "a%b"]
    assert len({redis_key("p", n, "t", 0, k) for n in names}) == len(names)
