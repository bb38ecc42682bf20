"""Ready Beam pipelines (batch ETL, streaming features) and the feature code they share."""
