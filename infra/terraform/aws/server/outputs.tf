output "public_ip" {
  description = "Elastic IP of the server (clients and browsers reach it here)."
  value       = aws_eip.this.public_ip
}

output "project_url" {
  description = "Master URL of the BOINC project, what the fleet's hosts attach to."
  value       = "${local.url_base}/${var.project_path}/"
}

output "instance_id" {
  description = "EC2 instance id of the server (for SSM Session Manager)."
  value       = aws_instance.this.id
}

output "weak_key_secret_arn" {
  description = "Secrets Manager secret to store the weak account key in; the fleet module's hosts read it."
  value       = aws_secretsmanager_secret.weak_key.arn
}

output "redis_password_secret_arn" {
  description = "Secrets Manager secret holding the stack's Redis password."
  value       = aws_secretsmanager_secret.redis_password.arn
}

output "kms_key_arn" {
  description = "KMS key encrypting the volumes and secrets (the fleet's hosts need kms:Decrypt on it for the weak key)."
  value       = local.kms_key
}

output "security_group_id" {
  description = "Security group of the server."
  value       = aws_security_group.this.id
}

output "role_name" {
  description = "IAM role of the server VM (attach the fleet controller's policy to run the controller there)."
  value       = aws_iam_role.this.name
}
