output "mig_name" {
  description = "SPOT managed instance group: fleet.yaml gcp.mig."
  value       = google_compute_instance_group_manager.this["spot"].name
}

output "on_demand_mig_name" {
  description = "On-demand twin group (null without on_demand_name): fleet.yaml gcp.on_demand_mig."
  value       = var.on_demand_name == null ? null : google_compute_instance_group_manager.this["on_demand"].name
}

output "zone" {
  description = "Zone of the groups: fleet.yaml gcp.zone."
  value       = var.zone
}

output "machine_type" {
  description = "Machine type of the hosts: fleet.yaml gcp.machine_type."
  value       = var.machine_type
}

output "controller_service_account" {
  description = "Service account with the controller's roles on these groups."
  value       = google_service_account.controller.email
}

output "host_service_account" {
  description = "Service account of the hosts (reads the weak-key secret only)."
  value       = google_service_account.host.email
}
