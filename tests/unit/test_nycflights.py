import pyarrow as pa

from pipelines.flights.nycflights import TABLES, load_table


def test_demo_tables_load_as_arrow():
    flights = load_table("flights")
    assert flights.num_rows == 336_776
    assert flights.schema.field("time_hour").type == pa.timestamp("s", tz="UTC")
    assert flights.schema.field("tailnum").type == pa.string()
    assert flights.column("arr_delay").null_count > 0  # cancelled flights
    for name in TABLES:
        assert load_table(name).num_rows > 0
