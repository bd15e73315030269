"""The service's configuration: the YAML file read section by section (config_file), the
reader every section uses (config_reader), and the access, server and TLS sections
(access_config)."""
