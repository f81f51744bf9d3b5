"""terarec: train and serve CTR models whose sparse embedding tables outgrow one machine."""

from terarec.types import Batch, FeatureSchema, FieldSpec, KeyedIds

__all__ = ["Batch", "FeatureSchema", "FieldSpec", "KeyedIds"]
__version__ = "0.1.0"
