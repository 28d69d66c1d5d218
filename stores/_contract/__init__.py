"""The FeatureStore conformance suite, by concern; :mod:`stores.testing` combines it."""
