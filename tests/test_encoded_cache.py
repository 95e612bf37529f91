"""The Router's cache of encoded images (deployments/encoded_cache.py; no Ray)."""
from PIL import Image

from deployments.encoded_cache import EncodedCache, content_key


def test_keys_follow_content_and_view_options(tmp_path):
    png = tmp_path / "a.png"
    Image.new("RGB", (30, 20), (1, 2, 3)).save(png)
    data = png.read_bytes()
    assert content_key(data, "gundam", 6) == content_key(str(png), "gundam", 6)  # a path reads the bytes
    assert content_key(data, "gundam", 6) != content_key(data, "gundam", 9)
    assert content_key(data, "gundam", 6) != content_key(data, "base", 6)
    picture = Image.open(png)
    assert content_key(picture, "gundam", 6) == content_key(Image.new("RGB", (30, 20), (1, 2, 3)), "gundam", 6)
    assert content_key(picture, "gundam", 6) != content_key(Image.new("RGB", (30, 20), (1, 2, 4)), "gundam", 6)
    assert content_key(str(tmp_path / "missing.png"), "gundam", 6) is None
    assert content_key(12, "gundam", 6) is None


def test_least_recently_used_leave_first_within_the_byte_cap():
    cache = EncodedCache(max_bytes=100)
    for key in "abc":
        cache.put(key, key.upper(), 40)  # c pushes a out (120 > 100)
    assert cache.get("a") is None and cache.get("b") == "B"
    cache.put("d", "D", 40)  # b was used last: c leaves
    assert cache.get("c") is None and cache.get("b") == "B" and cache.get("d") == "D"
    cache.put("huge", "X", 101)  # larger than the whole cache: not kept, nothing evicted
    assert cache.get("huge") is None and cache.get("b") == "B"
    cache.put(None, "unkeyed", 1)
    stats = cache.stats()
    assert stats["bytes"] == 80 <= stats["max_bytes"] and stats["entries"] == 2
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (4, 3, 2)
    assert stats["hit_rate"] == 4 / 7
