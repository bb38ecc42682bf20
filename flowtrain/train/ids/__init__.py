"""IDs that grow: dynamic, collisionless embedding tables for high-cardinality ID columns.

``keys`` (an ID value -> its stable 64-bit key, or the reason it has none), ``table`` (``IdTable``:
key -> row with a free list, frequency filtering, expiry, a bound with least-recently-seen
eviction, per-row optimizer state, deltas), ``embedding`` (``IdEmbedding`` for one process,
``ShardedIdEmbedding`` row-wise across data-parallel ranks by all-to-all), ``delta`` (published
versions that carry only the changed rows, applied in order by a scorer). See docs/ids.md.
"""
from connectors.id_keys import DEFAULT_MAX_ID_BYTES, NO_KEY, KeyReasons, id_text, key_of, keys_of
from flowtrain.train.ids.embedding import IdEmbedding, ShardedIdEmbedding, gather_full_table, owner_of
from flowtrain.train.ids.table import Delta, IdTable, TableStats

__all__ = ["DEFAULT_MAX_ID_BYTES", "NO_KEY", "Delta", "IdEmbedding", "IdTable", "KeyReasons", "ShardedIdEmbedding",
           "TableStats", "gather_full_table", "id_text", "key_of", "keys_of", "owner_of"]
