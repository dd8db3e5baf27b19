-- The database the compose pipeline captures (docker-compose.yml: postgres, then Debezium).
-- REPLICA IDENTITY FULL: Debezium then sends unchanged TOAST values with every update, where
-- the default identity sends a placeholder the job would quarantine (docs: From Kafka and Debezium).
CREATE TABLE orders (id INT PRIMARY KEY, note TEXT, amount NUMERIC(10, 2));
ALTER TABLE orders REPLICA IDENTITY FULL;
INSERT INTO orders VALUES (1, 'first', 9.50), (2, 'second', 12.00), (3, 'third', 3.25);
