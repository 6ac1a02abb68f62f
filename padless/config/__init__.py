"""Run settings: the pydantic sections every config is built from, how a YAML file and overrides are read, and
the names users choose among."""
