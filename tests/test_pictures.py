"""Pictures: a RequestGraph and the radix tree as SVG, parsed (not eyeballed): the labels, token
counts and states they show are the graph's and the tree's; large trees stay bounded; building
a view never changes the tree."""

from __future__ import annotations

import io
import random
import types
import xml.etree.ElementTree as ET

from hypothesis import given, settings
from hypothesis import strategies as st

from flowlang import assistant, gen, program, system, user
from flowlang.backends.mock import MockBackend
from programs.brainstorm import brainstorm
from runtime.cache.allocator import SlotAllocator
from runtime.cache.radix import RadixCache
from runtime.cache.view import build_cache_view
from runtime.prefix import common_prefix_len

SVG = "{http://www.w3.org/2000/svg}"


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)  # raises on anything that is not well-formed XML
    assert root.tag == f"{SVG}svg"
    assert float(root.get("width")) > 0 and float(root.get("height")) > 0
    return root


def texts(root: ET.Element, css_class: str | None = None) -> list[str]:
    return [
        t.text or ""
        for t in root.iter(f"{SVG}text")
        if css_class is None or t.get("class") == css_class
    ]


def groups(root: ET.Element, css_class: str) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if css_class in (g.get("class") or "").split()]


# ---------------------------------------------------------------------- request graphs


def test_a_graph_picture_shows_its_nodes_prompt_sizes_and_shared_prefix():
    graph = brainstorm.compile("saving energy at home", 16, backend=MockBackend())
    root = parse(graph.to_svg())
    assert graph._repr_svg_() == graph.to_svg()
    titles = texts(root, "title")
    assert titles.count("gen idea") == 3
    assert "select best" in titles
    assert "fork f1 \u00d73" in titles and "join f1 (gather)" in titles
    lines = texts(root, "line")
    ideas = [r for r in graph.requests if r.name == "idea"]
    assert lines.count(f"prompt {len(ideas[0].prompt_ids)} tok") == 3
    best = next(r for r in graph.requests if r.name == "best")
    assert f"prompt {len(best.prompt_ids)} tok" in lines
    assert "prompt holds generated text" not in lines  # gather: the trunk stays static
    shared = min(common_prefix_len(ideas[0].prompt_ids, r.prompt_ids) for r in ideas)
    assert f"shared prefix {shared} tok: computed once," in lines
    assert "3 choices: 1 | 2 | 3" in lines
    # the system and user text before the fork is read by all 4 requests
    assert len(groups(root, "shared")) >= 1
    assert any("read by 4 requests" in t for t in titles)
    assert "max 16 new tok" in lines
    summary = texts(root, "summary")[0]
    assert f"{len(graph.requests)} requests" in summary


@program
def chat(s, turns):
    s += system("Be brief.")
    for i, message in enumerate(turns):
        s += user(message)
        s += assistant(gen(f"reply_{i}", max_new_tokens=4))


def test_prompts_after_a_generation_are_marked_dynamic_and_role_ends_make_no_box():
    graph = chat.compile(["Hi", "And then?"], backend=MockBackend())
    root = parse(graph.to_svg())
    lines = texts(root, "line")
    assert f"prompt {len(graph.requests[0].prompt_ids)} tok" in lines
    assert "prompt holds generated text" in lines
    assert not [t for t in texts(root, "title") if t.startswith("text \u00b7 0 chars")]
    assert "1 prompts hold generated text" in texts(root, "summary")[0]


# ---------------------------------------------------------------------- the radix tree


def insert(cache: RadixCache, ids: list[int]) -> None:
    """Insert `ids` with fresh slots, freeing those the tree already had (duplicates)."""
    slots = cache.allocator.alloc(len(ids))
    done = cache.insert(ids, slots)
    if done.prefix_len:
        cache.allocator.free(slots[: done.prefix_len])


def node_sum(view) -> tuple[int, int]:
    """(nodes, tokens) the view accounts for: shown plus summarised."""
    nodes = tokens = 0
    for ns in view.namespaces:
        nodes, tokens = nodes + ns.hidden_nodes, tokens + ns.hidden_tokens
    for node in view.nodes():
        nodes += 1 + node.hidden_nodes
        tokens += node.num_tokens + node.hidden_tokens
    return nodes, tokens


def test_a_tree_picture_shows_sizes_states_pins_and_eviction_order():
    cache = RadixCache(SlotAllocator(num_slots=4096), 1, "lru")
    for ids in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3, 9], [20, 21]):
        insert(cache, ids)
    pinned = cache.match_prefix([1, 2, 3])
    cache.lock(pinned.position)  # as a pin does
    running = cache.match_prefix([1, 2, 3, 7, 8])
    cache.lock(running.position)  # as a running request does
    pin = types.SimpleNamespace(lock_pos=pinned.position, namespace=None)
    view = build_cache_view(cache, {"pin-a": pin}, render=lambda ids: "-".join(map(str, ids)))
    cache.check_integrity()
    by_label = {n.label: n for n in view.nodes()}
    assert by_label["'1-2-3'"].state == "pinned" and by_label["'1-2-3'"].num_pins == 1
    assert by_label["'1-2-3'"].lock_ref == 2  # the pin and the request below it
    assert by_label["'7-8'"].state == "locked" and by_label["'7-8'"].num_pins == 0
    states = sorted((n.num_tokens, n.state) for n in view.nodes())
    assert states == [(1, "evictable"), (2, "evictable"), (2, "locked"), (3, "evictable"),
                      (3, "pinned")]  # fmt: skip
    ranked = sorted((n for n in view.nodes() if n.evict_rank), key=lambda n: n.evict_rank)
    first = ranked[0]
    assert cache.evict(first.num_tokens) == first.num_tokens  # rank 1 is what goes first
    after = build_cache_view(cache, {"pin-a": pin}, render=lambda ids: "-".join(map(str, ids)))
    assert first.label not in {n.label for n in after.nodes()}
    assert view.pins[0].pin_id == "pin-a" and view.pins[0].num_tokens == 3
    root = parse(view.to_svg())
    assert "3 tok \u00b7 r=2" in texts(root, "tokens")  # the pin and the running request
    assert len(groups(root, "pinned")) == 1 and len(groups(root, "locked")) == 1
    assert len(groups(root, "evictable")) == 3
    assert "pinned \u00d71" in texts(root, "badge") and "evict #1" in texts(root, "badge")
    summary = texts(root, "summary")[0]
    assert "11 tokens cached of 4,096 slots" in summary and "5 nodes" in summary


def test_large_trees_are_summarised_and_the_picture_stays_bounded():
    cache = RadixCache(SlotAllocator(num_slots=1 << 20), 1, "lru")
    rng = random.Random(1)
    system_ids = list(range(512))
    for _ in range(3000):
        ids = system_ids + [rng.randrange(8) for _ in range(3)] + [rng.randrange(9999)] * 20
        insert(cache, ids)
    cache.check_integrity()
    assert cache.num_nodes > 2000
    view = build_cache_view(cache, {}, max_nodes=40)
    assert view.num_shown == 40 and view.num_nodes == cache.num_nodes
    assert node_sum(view) == (cache.num_nodes, cache.total_size)
    svg = view.to_svg()
    root = parse(svg)
    assert len(svg) < 40_000 and float(root.get("height")) < 6_000
    hidden = [t for t in texts(root) if t.startswith("+") and " tok" in t]
    assert hidden, "what the view leaves out is said"


@st.composite
def operations(draw):
    return draw(
        st.lists(
            st.tuples(
                st.sampled_from(["insert", "lock", "unlock", "evict"]),
                st.lists(st.integers(0, 5), min_size=1, max_size=12),
            ),
            min_size=1,
            max_size=40,
        )
    )


@settings(max_examples=60, deadline=None)
@given(operations(), st.integers(1, 12))
def test_views_account_for_every_node_and_token_and_never_change_the_tree(ops, max_nodes):
    cache = RadixCache(SlotAllocator(num_slots=1024), 1, "lru")
    locks = []
    for op, ids in ops:
        if op == "insert":
            insert(cache, ids)
        elif op == "lock":
            match = cache.match_prefix(ids)
            if match.prefix_len:
                cache.lock(match.position)
                locks.append(match.position)
        elif op == "unlock" and locks:
            cache.unlock(locks.pop())
        elif op == "evict":
            cache.evict(len(ids))
        cache.check_integrity()
        pins = {f"p{i}": types.SimpleNamespace(lock_pos=p, namespace=None)
                for i, p in enumerate(locks)}  # fmt: skip
        before = cache.pretty_print(io.StringIO())
        view = build_cache_view(cache, pins, max_nodes=max_nodes)
        assert cache.pretty_print(io.StringIO()) == before
        cache.check_integrity()
        assert view.num_shown <= max_nodes
        assert node_sum(view) == (cache.num_nodes, cache.total_size)
        assert sum(n.lock_ref > 0 for n in view.nodes()) <= cache.num_nodes
        for node in view.nodes():
            assert (node.state == "evictable") == (node.lock_ref == 0)
        pinned = set()
        for position in locks:  # every lock here is a pin: their paths are shown first
            node = cache.resolve(position)
            while node.parent is not None:
                pinned.add(id(node))
                node = node.parent
        assert sum(1 for n in view.nodes() if n.num_pins) == min(max_nodes, len(pinned))
        parse(view.to_svg())


def test_the_engine_draws_its_own_tree_with_pins_and_decoded_text(tiny_model_dir):
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    with Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096)) as engine:
        prefix = "Lighthouses guide ships along the rocky coast at night."
        pin = engine.pin(prefix)
        params = SamplingParams(max_new_tokens=4, temperature=0)
        engine.generate([GenerateRequest(text=prefix + f" Tale {i}.", sampling=params)
                         for i in range(3)])  # fmt: skip
        view = engine.cache_view()
        stats = engine.stats()
        pin.release()
        after = engine.cache_view()
    assert view.total_tokens == stats["cache_tokens"] and view.num_nodes == stats["cache_nodes"]
    assert [p.pin_id for p in view.pins] == [pin.pin_id]
    assert view.pins[0].num_tokens == pin.info.num_tokens
    pinned = [n for n in view.nodes() if n.state == "pinned"]
    assert sum(n.num_tokens for n in pinned) == pin.info.num_tokens
    assert pinned[0].label.startswith("'Lighthouses")
    assert not after.pins and not [n for n in after.nodes() if n.state == "pinned"]
    assert "Lighthouses" in " ".join(texts(parse(view._repr_svg_()), "label"))


def test_replicas_trees_merge_into_one_picture_each_namespace_tagged():
    from runtime.cache.view import merge_views

    views = {}
    for replica, prompts in ((0, ([1, 2, 3], [1, 2, 4])), (3, ([7, 8],))):
        cache = RadixCache(SlotAllocator(num_slots=64), 1, "lru")
        for ids in prompts:
            insert(cache, ids)
        views[replica] = build_cache_view(cache, {})
    merged = merge_views(views)
    assert [ns.replica for ns in merged.namespaces] == [0, 3]
    assert merged.total_tokens == 6 and merged.num_nodes == 4 and merged.capacity_tokens == 128
    headings = texts(parse(merged.to_svg()), "namespace")
    assert headings == ["replica 0 \u00b7 namespace None", "replica 3 \u00b7 namespace None"]
