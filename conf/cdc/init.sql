-- The database the compose pipeline captures (docker-compose.yml: postgres, then Debezium).
-- At PostgreSQL's and Debezium's defaults (the default replica identity, precise decimals): the
-- job decodes what Debezium sends (docs: From Kafka and Debezium).
CREATE TABLE orders (id INT PRIMARY KEY, note TEXT, amount NUMERIC(10, 2), placed DATE, at TIMESTAMPTZ);
INSERT INTO orders VALUES (1, 'first', 9.50, '2025-01-15', now()), (2, 'second', 12.00, '2025-01-16', now()),
  (3, 'third', 3.25, NULL, NULL);
