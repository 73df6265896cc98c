output "public_ip" {
  description = "Static external address of the server."
  value       = google_compute_address.this.address
}

output "project_url" {
  description = "Master URL of the BOINC project, what the fleet's hosts attach to."
  value       = "${local.url_base}/${var.project_path}/"
}

output "instance_name" {
  description = "Name of the server VM."
  value       = google_compute_instance.this.name
}

output "weak_key_secret_id" {
  description = "Secret Manager secret (projects/P/secrets/S) to add the weak account key to; the fleet's hosts read it."
  value       = google_secret_manager_secret.weak_key.id
}

output "weak_key_secret_name" {
  description = "Short id of the weak-key secret (for gcloud secrets versions add)."
  value       = google_secret_manager_secret.weak_key.secret_id
}

output "redis_password_secret_id" {
  description = "Secret Manager secret holding the stack's Redis password."
  value       = google_secret_manager_secret.redis_password.id
}

output "service_account" {
  description = "Service account of the server VM (give it the fleet controller's roles to run the controller there)."
  value       = google_service_account.server.email
}
