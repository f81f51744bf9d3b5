"""AutoFeature: count, cross-count and group-by aggregates computed with DuckDB SQL over the
training files, stored as Parquet tables, and joined onto any rows as new fields.

    engine = AutoFeatureEngine(memory_limit="2GB", temp_dir="/scratch/duckdb")
    cands = enumerate_candidates(schema, cardinalities=engine.cardinalities(train, schema))
    tables = compute_tables(cands, train, schema, "features/", engine=engine)
    apply_file(tables, "valid.txt", schema, "valid.parquet", engine=engine)
    new_schema = extend_schema(schema, tables)
"""

from terarec.autofeature.candidates import (
    ALL_AGGREGATES,
    ALL_KINDS,
    Aggregate,
    AutoFeatureError,
    Candidate,
    CandidateKind,
    enumerate_candidates,
    validate_candidates,
)
from terarec.autofeature.engine import AutoFeatureEngine, compute_tables, default_engine
from terarec.autofeature.tables import FeatureTable, FeatureTables, extend_schema
from terarec.autofeature.transform import apply, apply_file

__all__ = [
    "ALL_AGGREGATES", "ALL_KINDS", "Aggregate", "AutoFeatureEngine", "AutoFeatureError",
    "Candidate", "CandidateKind", "FeatureTable", "FeatureTables", "apply", "apply_file",
    "compute_tables", "default_engine", "enumerate_candidates", "extend_schema",
    "validate_candidates",
]
