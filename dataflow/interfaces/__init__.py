"""The interfaces other packages implement: a feature store and a ref stream."""
